"""The plain step on its own (no Spark, no ring): a batch's weighted loss over several heads, the
figures the loop sums, and a model whose outputs do not match labelCol named as such."""
import pytest
import torch
from pyspark.ml.linalg import VectorUDT
from pyspark.sql import types as T

from sparkring.data.spec import FeatureSpec
from sparkring.trainer.config import TrainConfig
from sparkring.trainer.figures import Totals
from sparkring.trainer.losses import metric_fns
from sparkring.trainer.step import PlainStep

SCHEMA = T.StructType([T.StructField("features", VectorUDT()), T.StructField("a", T.DoubleType()),
                       T.StructField("b", T.DoubleType())])


def _config(labels, losses, weights, metrics=None):
    spec = FeatureSpec.build(SCHEMA, features=["features"], labels=labels)
    return TrainConfig(model=None, optimizer=None, losses=losses, metrics=metric_fns(metrics), dataset=None,
                       store=None, run_id="r", spec=spec, loss_weights=weights, batch_size=4, val_batch_size=4,
                       epochs=1, shuffle=False, seed=0, backward_passes_per_step=1, compression="none",
                       lr_scaling="none", warmup_epochs=0.0, train_steps=1, val_steps=0,
                       multi_head=len(labels) > 1)


class TwoHeads(torch.nn.Module):
    def forward(self, x):
        return x[:, :1], x[:, 1:2]


def test_two_heads_give_the_weighted_total_and_each_heads_figures_summed_over_rows():
    cfg = _config(["a", "b"], ["mse", "mse"], [1.0, 0.5])
    step = PlainStep(cfg, torch.device("cpu"), rank=0)
    batch = {"features": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "a": torch.tensor([0.0, 0.0]),
             "b": torch.tensor([2.0, 4.0])}
    total, heads, ys, head_losses = step(TwoHeads(), batch, "epoch 0, training batch 0")
    assert [float(x) for x in head_losses] == [5.0, 0.0]  # mean of 1 and 9; b matches exactly
    assert float(total) == 5.0 and step.output_shapes == [[1], [1]]
    figures = step.figures(total, heads, ys, head_losses)
    # total x rows, rows, then per head: its loss x rows
    assert figures.tolist() == [10.0, 2.0, 10.0, 0.0] and cfg.log_names() == ["a_loss", "b_loss"]


def test_a_model_with_fewer_outputs_than_labels_is_named_with_the_fix():
    step = PlainStep(_config(["a", "b"], ["mse", "mse"], [1.0, 1.0]), torch.device("cpu"), rank=3)
    batch = {"features": torch.ones(2, 2), "a": torch.zeros(2), "b": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"returned 1 output\(s\) but labelCol names 2 labels") as info:
        step(torch.nn.Linear(2, 1), batch, "epoch 1, training batch 7")
    assert "sparkring: on rank 3, epoch 1, training batch 7" in getattr(info.value, "__notes__", [])


def test_validation_figures_read_as_val_loss_and_val_metrics():
    cfg = _config(["a"], ["mse"], [1.0], metrics={"first": lambda out, y: out.flatten()[0]})
    step = PlainStep(cfg, torch.device("cpu"), rank=0)
    assert step.validation_ended(None, Totals.of(torch.tensor([6.0, 3.0, 1.5], dtype=torch.float64))) == {
        "val_loss": 2.0, "val_first": 0.5}
    assert step.validation_ended(None, Totals.of(torch.zeros(3, dtype=torch.float64))) == {}


def test_a_class_index_out_of_range_after_the_first_batch_is_named_as_on_the_first():
    schema = T.StructType([T.StructField("features", VectorUDT()), T.StructField("label", T.DoubleType())])
    spec = FeatureSpec.build(schema, features=["features"], labels=["label"])
    cfg = TrainConfig(model=None, optimizer=None, losses=["cross_entropy"], metrics=metric_fns(None), dataset=None,
                      store=None, run_id="r", spec=spec, loss_weights=[1.0], batch_size=4, val_batch_size=4,
                      epochs=1, shuffle=False, seed=0, backward_passes_per_step=1, compression="none",
                      lr_scaling="none", warmup_epochs=0.0, train_steps=1, val_steps=0, multi_head=False)
    step, model = PlainStep(cfg, torch.device("cpu"), rank=1), torch.nn.Linear(2, 3)
    good = {"features": torch.ones(2, 2), "label": torch.tensor([0.0, 2.0])}
    total, heads, ys, head_losses = step(model, good, "epoch 0, training batch 0")  # checked in full
    assert step.figures(total, heads, ys, head_losses)[1] == 2.0
    with pytest.raises(ValueError, match=r"label value 7 is out of range for a model with 3 outputs") as info:
        step(model, {"features": torch.ones(2, 2), "label": torch.tensor([1.0, 7.0])}, "epoch 2, training batch 5")
    assert "sparkring: on rank 1, epoch 2, training batch 5" in getattr(info.value, "__notes__", [])
