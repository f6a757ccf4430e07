"""The model's input layer against the features' width, found by a forward on the meta device (fast layer)."""
import pytest
import torch

from sparkring.data import DataError
from sparkring.data.spec import SCALAR, TENSOR, ColumnSpec, FeatureSpec, InputSpec
from sparkring.estimator.input_layer import check_input_layer, first_layer


def _spec(width, *, integral=False, shape=None):
    column = ColumnSpec("features", TENSOR, "int64" if integral else "float64", levels=1, vector=True,
                        shape=(width,))
    return FeatureSpec(columns=(column, ColumnSpec("label", SCALAR, "float64")),
                       inputs=(InputSpec("features", ("features",), integral=integral, shape=shape),),
                       labels=("label",))


class RegisteredBackwards(torch.nn.Module):
    """Its head is registered before its body: the forward, not the order, says which layer comes first."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(16, 3)
        self.body = torch.nn.Linear(64, 16)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


class NeedsValues(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(32, 3)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent: cannot run on meta
            return self.fc(x)
        return self.fc(x)


def test_a_first_linear_narrower_than_the_features_is_refused_naming_both_widths_and_the_fix():
    net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    with pytest.raises(DataError, match=r"first layer '0' is Linear\(in_features=32, out_features=128\) but the "
                                        r"feature column\(s\) 'features' \(64 values per row\) give it 64 values: "
                                        r"build it as Linear\(64, 128\)"):
        check_input_layer(net, _spec(64))
    check_input_layer(torch.nn.Sequential(torch.nn.Linear(64, 10)), _spec(64))


def test_the_layer_the_forward_reaches_first_is_checked_not_the_first_registered():
    found = first_layer(RegisteredBackwards(), [torch.empty(2, 64, device="meta")])
    assert found.name == "body" and found.given.shape[-1] == 64
    check_input_layer(RegisteredBackwards(), _spec(64))
    with pytest.raises(DataError, match=r"first layer 'body' is Linear\(in_features=64, out_features=16\) but .* "
                                        r"\(80 values per row\) give it 80 values"):
        check_input_layer(RegisteredBackwards(), _spec(80))


def test_input_shapes_and_a_flatten_are_followed_to_the_width_the_linear_receives():
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3, padding=1), torch.nn.Flatten(), torch.nn.Linear(100, 10))
    with pytest.raises(DataError, match=r"reshaped by inputShapes to \[1, 8, 8\]\) give it 128 values"):
        check_input_layer(net, _spec(64, shape=(1, 8, 8)))
    check_input_layer(torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3, padding=1), torch.nn.Flatten(),
                                          torch.nn.Linear(128, 10)), _spec(64, shape=(1, 8, 8)))


def test_an_embedding_given_float_features_is_refused_and_given_ids_is_not():
    net = torch.nn.Sequential(torch.nn.Embedding(100, 4), torch.nn.Flatten(), torch.nn.Linear(12, 1))
    with pytest.raises(DataError, match=r"first layer '0' is an Embedding, which takes integer ids"):
        check_input_layer(net, _spec(3))
    check_input_layer(net, _spec(3, integral=True))


class CastingEmbedding(torch.nn.Embedding):
    def forward(self, ids):
        return super().forward(ids.long())


def test_a_layer_with_its_own_forward_is_judged_by_what_it_passes_on():
    fits = torch.nn.Sequential(CastingEmbedding(100, 4), torch.nn.Flatten(), torch.nn.Linear(12, 1))
    check_input_layer(fits, _spec(3))  # the floats are cast by the layer itself: no refusal
    too_narrow = torch.nn.Sequential(CastingEmbedding(100, 4), torch.nn.Flatten(), torch.nn.Linear(8, 1))
    with pytest.raises(DataError, match=r"first layer '2' is Linear\(in_features=8.* give it 12 values"):
        check_input_layer(too_narrow, _spec(3))


def test_a_forward_that_needs_real_values_is_left_to_the_ranks_and_the_weights_are_untouched():
    model = NeedsValues()
    before = model.fc.weight.detach().clone()
    check_input_layer(model, _spec(64))  # the ranks will say it; no false refusal here
    assert torch.equal(model.fc.weight, before) and model.fc.weight.device.type == "cpu"


class Watching(torch.nn.Module):
    """Its forward looks at another module, as a thread pickling that module meanwhile would see it."""

    watched = None
    seen: list = []

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 3)

    def forward(self, x):
        w = Watching.watched
        Watching.seen.append((len(w.fc._forward_pre_hooks), w.fc.weight.device.type))
        return self.fc(x)


def test_the_check_runs_on_a_twin_and_never_changes_the_users_module_meanwhile():
    model = Watching()
    Watching.watched = model
    check_input_layer(model, _spec(64))
    # the forward ran (on the twin); the user's module kept its weights and had no hook at any moment
    assert Watching.seen == [(0, "cpu")] and model.fc.weight.device.type == "cpu" and not model.fc._forward_pre_hooks
    with pytest.raises(DataError, match="first layer 'fc'"):
        check_input_layer(model, _spec(32))
