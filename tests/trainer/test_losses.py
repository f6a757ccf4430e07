"""Named losses and metrics: what labels they take, and the names refused (fast layer)."""
import pytest
import torch

from sparkring.trainer.losses import check_loss, compute_loss, label_kind, metric_fns


def test_loss_names_decide_the_label_kind_and_unknown_ones_list_the_known():
    assert [label_kind(n) for n in ("cross_entropy", "bce_with_logits", "mse")] == ["class", "binary", "regression"]
    with pytest.raises(ValueError, match=r"loss='hinge' is not a known loss name; use one of \["):
        check_loss("hinge")
    out, y = torch.tensor([[2.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 1])
    weighted = compute_loss("cross_entropy", out, y, torch.tensor([1.0, 0.0]))
    assert torch.isclose(weighted, torch.nn.functional.cross_entropy(out[:1], y[:1]))


def test_metrics_by_name_or_callable_and_unknown_names_are_refused():
    fns = metric_fns(["accuracy", lambda out, y: out.sum()])
    assert list(fns)[0] == "accuracy"
    assert fns["accuracy"](torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1])).item() == 0.5
    with pytest.raises(ValueError, match="metric 'f1' is not known"):
        metric_fns("f1")
