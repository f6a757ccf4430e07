"""The speed switches: bf16-mixed fits as well as float32, 16-mixed scales the loss and skips an
overflowing step on every rank alike, Compression.bf16 on the wire, torch.compile trains the
eager weights and leaves no compiled wrapper in the fitted model."""
import est_helpers as H
import pytest
import rank_fns
import torch
from pyspark.ml.linalg import Vectors

from sparkring import SparkRingEstimator, Store, run


def _digits_df(spark):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    rows = [(i, Vectors.dense(x[i] / 16.0), float(y[i]), i % 5 == 0) for i in range(len(y))]
    return spark.createDataFrame(rows, ["id", "features", "label", "held_out"]).repartition(2, "id")


def _digits_fit(df, store, **kw):
    def model():
        return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

    params = dict(model=model, optimizer=lambda p: torch.optim.Adam(p, lr=3e-3), loss="cross_entropy",
                  metrics=["accuracy"], batchSize=32, epochs=6, numProc=2, validation="held_out", store=store,
                  verbose=0, seed=1)
    params.update(kw)
    return SparkRingEstimator(**params).fit(df)


def test_bf16_mixed_fit_reaches_the_held_out_accuracy_of_float32(spark, tmp_path):
    df = _digits_df(spark)
    full = _digits_fit(df, Store(str(tmp_path / "f32")), timeline=str(tmp_path / "trace" / "fit.json"))
    mixed = _digits_fit(df, Store(str(tmp_path / "bf16")), precision="bf16-mixed")
    assert full.history[-1]["val_accuracy"] > 0.9
    assert mixed.history[-1]["val_accuracy"] == pytest.approx(full.history[-1]["val_accuracy"], abs=0.02)
    # the fitted model is float32 and predicts without autocast
    assert all(p.dtype == torch.float32 for p in mixed.getModel().parameters())
    # where each epoch's seconds went, always in the history: rank 0's and the slowest rank's
    for h in full.history:
        parts = [h[f"time_{p}"] for p in ("data", "compute", "comm", "other")]
        assert all(v >= 0 for v in parts) and h["time_compute"] > 0 and h["samples_per_second"] > 0
        assert all(h[f"time_{p}_slowest"] >= h[f"time_{p}"] for p in ("data", "compute", "comm", "other"))
    _check_timeline(tmp_path / "trace" / "fit.json", ranks=2, steps=len(full.history))
    # compute and comm hold the steps' forward and backward (the timeline's spans of them); comm is
    # only the time blocked in the gradient exchanges (inside the timeline's allreduce spans)
    import json

    spans = [e for e in json.load(open(tmp_path / "trace" / "fit.json"))["traceEvents"]
             if e["ph"] == "X" and e["pid"] == 0]
    forward_backward = sum(e["dur"] for e in spans if e["name"] in ("forward", "backward")) / 1e6
    exchanges = sum(e["dur"] for e in spans if e["name"] == "allreduce") / 1e6
    compute, comm = (sum(h[f"time_{part}"] for h in full.history) for part in ("compute", "comm"))
    assert compute + comm >= 0.9 * forward_backward
    assert 0 < comm <= exchanges * 1.05 + 0.01


def _check_timeline(path, ranks, steps):
    """The merged Chrome trace: one process per rank, every step's forward, backward and optimizer
    spans inside it, each gradient allreduce with its bytes, the start-up and checkpoints."""
    import json

    events = json.load(open(path))["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == set(range(ranks))
    for rank in range(ranks):
        mine = [e for e in spans if e["pid"] == rank]
        names = {e["name"] for e in mine}
        assert {"forward", "backward", "data wait", "start-up: join the ring (rendezvous, transports)",
                "validation"} <= names, names
        step_spans = [e for e in mine if e["name"].startswith("step ")]
        assert len(step_spans) >= steps
        for part in (e for e in mine if e["name"] in ("forward", "backward") or e["name"].startswith("optimizer")):
            assert any(s["ts"] <= part["ts"] and part["ts"] + part["dur"] <= s["ts"] + s["dur"] + 1
                       for s in step_spans), part
        exchanges = [e for e in mine if e["name"] == "allreduce"]
        assert exchanges and all(e["args"]["bytes"] > 0 and e["tid"] == 1 for e in exchanges)
    assert any(e["name"] == "checkpoint" for e in spans if e["pid"] == 0)


def test_16_mixed_fit_scales_the_loss_and_counts_the_steps_it_skipped(spark, tmp_path):
    df = _digits_df(spark)
    # gradients overflow on rank 1 at its 3rd step of epoch 0 and its 2nd of epoch 1 (22 steps an epoch)
    mixed = _digits_fit(df, Store(str(tmp_path / "f16")), precision="16-mixed", epochs=3,
                        model=H.OverflowAt(rank=1, calls=[2, 23]))
    assert [h["skipped_steps"] for h in mixed.history] == [1, 1, 0]  # on every rank alike: the fit went on
    assert mixed.history[-1]["val_accuracy"] > 0.85
    assert all(torch.isfinite(p).all() for p in mixed.getModel().parameters())


def test_an_overflowing_step_is_skipped_on_every_rank_alike(spark):
    results = run(rank_fns.grad_scaler_skips_alike, num_proc=2, verbose=0)
    assert results[0] == results[1]  # the same weights, scale and skips on both ranks
    weights, scale, skipped = results[0]
    assert skipped == [False, True, False] and scale == 2.0 ** 15  # step 2 overflowed on rank 1 only


def test_bf16_compression_reduces_gradients_close_to_float32(spark, tmp_path):
    trace = tmp_path / "run-trace.json"
    exact, compressed = run(rank_fns.bf16_compressed_training, num_proc=2, verbose=0,
                            env={"HOROVOD_TIMELINE": str(trace)})[0]  # Horovod's name for run()'s timeline
    torch.testing.assert_close(compressed, exact, atol=2e-2, rtol=2e-2)
    assert not torch.equal(compressed, exact)  # it did travel in bfloat16
    import json

    spans = [e for e in json.load(open(trace))["traceEvents"] if e["ph"] == "X"]
    for rank in (0, 1):
        mine = [e for e in spans if e["pid"] == rank]
        work = next(e for e in mine if e["name"] == "your function")
        exchanges = [e for e in mine if e["name"] == "allreduce"]
        assert len(exchanges) == 4 and all(e["args"]["bytes"] in (16 * 4 * 4 + 4 * 4, 16 * 4 * 2 + 4 * 2)
                                           for e in exchanges)  # two steps, float32 then bfloat16 on the wire
        assert all(work["ts"] <= e["ts"] and e["ts"] + e["dur"] <= work["ts"] + work["dur"] for e in exchanges)
        # a named allreduce: Horovod's negotiation phase inside the operation's span, with its bytes
        [whole] = [e for e in mine if e["name"] == "ALLREDUCE" and e["args"]["tensor"] == "final.loss"]
        [negotiation] = [e for e in mine if e["name"] == "NEGOTIATE_ALLREDUCE" and e["args"]["tensor"] == "final.loss"]
        assert whole["args"]["bytes"] == 8 * 4
        assert whole["ts"] <= negotiation["ts"] and negotiation["ts"] + negotiation["dur"] <= whole["ts"] + whole["dur"]


def test_a_compiled_fit_trains_the_eager_weights_and_saves_a_plain_module(spark, tmp_path):
    df = _digits_df(spark).limit(400)
    eager = _digits_fit(df, Store(str(tmp_path / "eager")), epochs=2, validation=None, metrics=None)
    compiled = _digits_fit(df, Store(str(tmp_path / "compiled")), epochs=2, validation=None, metrics=None,
                           compile=True)
    for (name, a), b in zip(eager.getModel().state_dict().items(), compiled.getModel().state_dict().values()):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4, msg=name)
    assert compiled.history[0]["first_step_seconds"] > 0 and "first_step_seconds" not in compiled.history[1]
    assert type(compiled.getModel()) is torch.nn.Sequential  # the module itself, not torch.compile's wrapper
    compiled.write().save(str(tmp_path / "saved"))
    from sparkring import SparkRingModel

    loaded = SparkRingModel.load(str(tmp_path / "saved"))
    assert loaded.transform(df.limit(5)).count() == 5
