"""The trainer's seams on their own, in a one-rank ring (no Spark): the checkpoint naming scheme and
which checkpoint is the latest, each placement's save / resume / update / gather, the plain step."""
import pytest
import torch

import sparkring.collective as sr
from sparkring.data import Store
from sparkring.trainer.checkpoints import (
    FILE,
    SHARDED,
    TRAINER_STATE,
    CheckpointName,
    latest,
    listing,
    prune,
    resume_point,
)
from sparkring.trainer.config import Sharding
from sparkring.trainer.placement import PlacementConfig, Replicated, Sharded
from sparkring.trainer.state import TrainerState


@pytest.fixture
def one_rank():
    sr.init()
    yield
    sr.shutdown()


@pytest.fixture
def store(tmp_path):
    return Store(str(tmp_path / "store"))


def _touch(store, run_id, name, *inside):
    store.write_bytes(store.checkpoint_path(run_id, name, *inside), b"x")


def test_checkpoint_names_order_steps_inside_an_epoch_before_its_end():
    names = ["epoch-00001.pt", "epoch-00001-step-0000007.pt", "epoch-00000.pt", "epoch-00001-step-0000012.pt"]
    ordered = sorted((CheckpointName.parse(n) for n in names), key=lambda c: c.position)
    assert [c.name for c in ordered] == ["epoch-00000.pt", "epoch-00001-step-0000007.pt",
                                         "epoch-00001-step-0000012.pt", "epoch-00001.pt"]
    assert [c.where() for c in ordered] == ["the start of epoch 2", "step 8 of epoch 2", "step 13 of epoch 2",
                                            "the start of epoch 3"]
    assert CheckpointName.parse("epoch-1.pt") is None and CheckpointName.parse("epoch-00001.ckpt") is None


def test_latest_is_the_newest_complete_checkpoint_of_either_kind(store):
    assert latest(store, "r") is None and resume_point(store, "r") == "the start"
    _touch(store, "r", "epoch-00000.pt")
    _touch(store, "r", "epoch-00001.dcp", "__0_0.distcp")  # shards written, trainer state not yet
    assert latest(store, "r").name == "epoch-00000.pt"
    _touch(store, "r", "epoch-00001.dcp", TRAINER_STATE)
    assert latest(store, "r").name == "epoch-00001.dcp" and resume_point(store, "r") == "the start of epoch 3"


def test_pruning_keeps_the_two_newest_of_a_kind(store):
    for name in ["epoch-00000.pt", "epoch-00001-step-0000003.pt", "epoch-00001.pt", "epoch-00000.dcp"]:
        _touch(store, "r", name)
    prune(store, "r", FILE)
    assert [c.name for c in listing(store, "r", FILE)] == ["epoch-00001-step-0000003.pt", "epoch-00001.pt"]
    assert [c.name for c in listing(store, "r", SHARDED)] == ["epoch-00000.dcp"]


def _state(epoch, step=None):
    return TrainerState(epoch=epoch, step=step, history=[{"epoch": epoch, "loss": 0.5}], seed=0, stopped=False,
                        early_stopping=(0.5, 1), schedulers=[], epoch_sums=None)


def _trained(placement, model):
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    wrapped = placement.distribute(opt, model)
    model(torch.ones(4, 3)).pow(2).sum().backward()
    assert placement.update(wrapped, model, skip_non_finite=False, scaler=None) == 0
    return wrapped


def test_replicated_resume_restores_weights_optimizer_and_the_loops_state(one_rank, store):
    placement = PlacementConfig(store=store, run_id="r").build()
    assert isinstance(placement, Replicated)
    model = placement.build(lambda: torch.nn.Linear(3, 2), torch.device("cpu"), seed=0)
    opt = _trained(placement, model)
    placement.save(model, opt, _state(0, step=5))
    fresh = placement.build(lambda: torch.nn.Linear(3, 2), torch.device("cpu"), seed=1)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    state = placement.resume(fresh, fresh_opt)
    assert state.step == 5 and state.history == [{"epoch": 0, "loss": 0.5}]
    torch.testing.assert_close(fresh.state_dict(), model.state_dict())
    assert fresh_opt.state_dict()["state"][0]["step"] == 1
    assert latest(store, "r").name == "epoch-00000-step-0000005.pt"
    placement.save(model, opt, _state(0))
    placement.save(model, opt, _state(1, step=2))  # the oldest of three goes
    assert [c.name for c in listing(store, "r", FILE)] == ["epoch-00000.pt", "epoch-00001-step-0000002.pt"]


def test_replicated_resume_falls_back_to_the_checkpoint_before_a_damaged_one(one_rank, store):
    placement = PlacementConfig(store=store, run_id="r").build()
    model = placement.build(torch.nn.Linear(3, 2), torch.device("cpu"), seed=0)
    opt = _trained(placement, model)
    placement.save(model, opt, _state(0))
    store.write_bytes(store.checkpoint_path("r", "epoch-00001.pt"), b"cut short")
    state = placement.resume(torch.nn.Linear(3, 2), torch.optim.Adam(torch.nn.Linear(3, 2).parameters()))
    assert state.epoch == 0


def test_replicated_update_skips_a_non_finite_gradient_only_when_asked(one_rank, store):
    placement = PlacementConfig(store=store, run_id="r").build()
    model = placement.build(torch.nn.Linear(3, 1), torch.device("cpu"), seed=0)
    opt = placement.distribute(torch.optim.SGD(model.parameters(), lr=0.1), model)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.full((1, 3), float("inf"))).sum().backward()
    assert placement.update(opt, model, skip_non_finite=True, scaler=None) == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.zero_grad()
    model(torch.ones(1, 3)).sum().backward()
    assert placement.update(opt, model, skip_non_finite=True, scaler=None) == 0
    assert not torch.equal(before[0], model.weight)


def test_a_fresh_start_resumes_nothing_and_every_rank_keeps_rank_zeros_weights(one_rank, store):
    placement = PlacementConfig(store=store, run_id="r").build()
    model = placement.build(torch.nn.Linear(3, 2), torch.device("cpu"), seed=0)
    assert placement.resume(model, torch.optim.SGD(model.parameters(), lr=0.1)) is None
    assert placement.gather(model).keys() == model.state_dict().keys()


def test_sharded_checkpoint_is_complete_only_with_its_trainer_state_and_resumes_the_same_weights(one_rank, store):
    sharding = Sharding(strategy="fsdp")
    placement = PlacementConfig(store=store, run_id="s", sharding=sharding).build()
    assert isinstance(placement, Sharded)
    model = placement.build(lambda: torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)),
                            torch.device("cpu"), seed=0)
    opt = _trained(placement, model)
    placement.save(model, opt, _state(2))
    placement.finish()
    assert latest(store, "s").name == "epoch-00002.dcp"
    gathered = placement.gather(model)
    again = PlacementConfig(store=store, run_id="s", sharding=sharding).build()
    fresh = again.build(lambda: torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)),
                        torch.device("cpu"), seed=7)
    state = again.resume(fresh, torch.optim.Adam(fresh.parameters(), lr=0.1))
    assert state.epoch == 2 and state.early_stopping == (0.5, 1)
    torch.testing.assert_close(again.gather(fresh), gathered)


def _half_frozen():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model[0].requires_grad_(False)  # as a LoRA fit's base weights: built the same on every start
    return model


@pytest.mark.parametrize("kind", ["replicated", "sharded"])
def test_a_checkpoint_keeps_only_the_parameters_that_train_and_resumes_them(one_rank, store, kind):
    sharding = Sharding(strategy="fsdp" if kind == "sharded" else "ddp")
    make = lambda: PlacementConfig(store=store, run_id=kind, sharding=sharding).build()  # noqa: E731
    placement = make()
    model = placement.build(_half_frozen, torch.device("cpu"), seed=0)
    opt = _trained(placement, model)
    placement.save(model, opt, _state(0))
    placement.finish()
    written = store.checkpoint_path(kind, latest(store, kind).name)
    if kind == "replicated":
        saved = torch.load(written, weights_only=True)["model"]
    else:
        from torch.distributed.checkpoint import FileSystemReader
        saved = {k.split(".", 1)[1]: v for k, v in FileSystemReader(written).read_metadata().state_dict_metadata.items()
                 if k.startswith("model.")}
    assert sorted(saved) == ["1.bias", "1.weight"]  # the frozen layer is not in it
    trained = placement.gather(model)
    again = make()
    fresh = again.build(_half_frozen, torch.device("cpu"), seed=0)
    assert again.resume(fresh, torch.optim.Adam(fresh.parameters(), lr=0.1)).epoch == 0
    torch.testing.assert_close(again.gather(fresh), trained)
