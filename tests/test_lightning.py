"""A user's own PyTorch Lightning Trainer across the ranks of sparkring.run() (its DDP, our layout)."""
import lightning_fns
import pytest
import torch

from sparkring import RankFailedError, run

pytest.importorskip("pytorch_lightning")


def test_a_lightning_trainer_inside_run_trains_like_one_process_on_the_whole_batches(spark):
    expected = lightning_fns.reference()
    results = run(lightning_fns.train_with_trainer, num_proc=2)
    assert [(r["rank"], r["world"], r["steps"]) for r in results] == [(0, 2, 8), (1, 2, 8)]
    for r in results:
        for key, value in expected.items():
            torch.testing.assert_close(r["state"][key], value, atol=1e-6, rtol=0)


def test_a_trainer_layout_that_does_not_match_the_ranks_is_refused_with_the_fix(spark):
    with pytest.raises(RankFailedError, match=r"Trainer\(devices=1, num_nodes=2\) does not match how sparkring "
                                              r"placed the ranks: 2 on this host, 1 host\(s\)"):
        run(lightning_fns.train_with_trainer, kwargs={"devices": 1, "num_nodes": 2}, num_proc=2)
