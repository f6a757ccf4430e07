"""The fitted model on the executors: deserialized once per worker and kept out of the garbage
collection PySpark runs after every task."""
import gc
import weakref

import torch

from sparkring.estimator.shipping import ShippedModel, _InlineBytes
from sparkring.runner import to_bytes


def _shipment(key: str, model: torch.nn.Module) -> ShippedModel:
    return ShippedModel(key, _InlineBytes(to_bytes(model)))


def test_a_loaded_model_is_left_out_of_later_garbage_collections_and_collected_once_evicted():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    try:
        first = _shipment("first", model).load(torch.device("cpu"))
        walked = {id(o) for o in gc.get_objects()}  # what a collection walks: not the frozen objects
        assert gc.get_freeze_count() > 0
        assert not {id(first), id(first[0]), id(first[0].weight)} & walked
        torch.testing.assert_close(first(torch.ones(1, 4)), model(torch.ones(1, 4)))
        first.cycle = [first]  # garbage only the cyclic collector frees, once the cache lets it go
        gone = weakref.ref(first)
        del first
        for key in ("second", "third"):  # the cache keeps two shipments: the first is evicted
            _shipment(key, model).load(torch.device("cpu"))
        assert gone() is None
    finally:
        gc.unfreeze()
