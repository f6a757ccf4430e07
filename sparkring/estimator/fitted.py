"""Where a fit left its model (the run's ``model/`` directory of safetensors in the Store) and the
module read back from there when it is asked for: on the driver by ``getModel()``, on the executors
by ``transform()``; the weights never travel through Spark's task results or the driver."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict

import cloudpickle
import torch

from ..trainer import is_factory, pretrained
from ..trainer.pretrained import HuggingFaceDirectory, StoredModel, WeightsSource
from ..trainer.stored import Location


@dataclass(frozen=True)
class FittedWeights:
    """A fitted model's weights on storage (``url``: a directory of safetensors, a path or URL, with
    the Store's ``storage_options``), and how its module is built around them.

    >>> weights = FittedWeights("/tmp/runs/r1/model")  # doctest: +SKIP
    >>> weights.load(lambda: MyNet(), torch.device("cpu")).fc.weight  # doctest: +SKIP
    """

    url: str
    storage_options: Dict[str, Any] = field(default_factory=dict)
    # the executors read them where they lie (a fit's Store, which its ranks wrote); a saved model's
    # place may be reachable with the driver's own credentials only: it ships from the driver
    executors_read: bool = True

    def load(self, recipe: Any, device: torch.device, seed: int = 0) -> torch.nn.Module:
        """The fitted module on ``device``: ``recipe`` (the model Param: a factory, a checkpoint
        directory, or a module, of which only the structure is used) built empty, filled from here."""
        stored = StoredModel(empty_module(recipe, self.storage_options),
                             [WeightsSource(Location(self.url, self.storage_options), strict=True)])
        return pretrained.materialized(stored, device, seed)


def empty_module(recipe: Any, storage_options: Dict[str, Any]) -> torch.nn.Module:
    """The module ``recipe`` builds, with no values: a factory's build under the meta device (its
    from_pretrained calls read configs only), a checkpoint directory's architecture, or a module's
    copy whose parameters are on the meta device (its buffers kept).

    >>> empty_module(torch.nn.Linear(2, 1), {}).weight.is_meta
    True
    """
    if isinstance(recipe, str):
        recipe = HuggingFaceDirectory(recipe, storage_options)
    if is_factory(recipe):
        return pretrained.empty_model(recipe, None, storage_options).module
    return pretrained.skeleton(recipe)


@dataclass(frozen=True)
class StoredFit:
    """A fitted model as the executors build it: its recipe pickled without any parameter's values
    (kilobytes) and its weights on storage, read where it is loaded.

    >>> stored_fit(lambda: MyNet(), weights).load(torch.device("cpu"))  # doctest: +SKIP
    """

    recipe: bytes
    weights: FittedWeights

    def load(self, device: torch.device) -> torch.nn.Module:
        """The fitted module on ``device``, read from storage."""
        return self.weights.load(cloudpickle.loads(self.recipe), device)


def stored_fit(recipe: Any, weights: FittedWeights) -> StoredFit:
    """``recipe`` (the model Param) and ``weights`` as the executors get them."""
    return StoredFit(pretrained.skeleton_bytes(recipe), weights)
