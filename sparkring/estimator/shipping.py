"""The fitted model's weights (and a text model's tokenizer) on the executors for transform():
shipped once per session while they are unchanged, deserialized once per Python worker (the
weights once per device too), never in every task's closure: a 32k-token BPE tokenizer takes
~50 ms to deserialize, a tokenizer directory ~90 ms to load, more than a small task's work.

A reused PySpark worker runs a full garbage collection after every task (pyspark/daemon.py), which
walks every object the worker holds: with torch, transformers and a model loaded that is ~0.3 s a
task on one core, more than a small task's whole work. The worker's objects are frozen out of the
collector (``gc.freeze``) once a model is loaded, so each task's collection only walks what
the task made; a model evicted from the cache is unfrozen and collected first.
"""
from __future__ import annotations

import gc
import logging
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple, Union

import cloudpickle
import torch

from ..data.text import Encoder
from ..runner import to_bytes
from .fitted import StoredFit

logger = logging.getLogger(__name__)

_worker_models: Dict[Tuple[str, str], torch.nn.Module] = {}  # (shipment, device) -> model
_worker_tokenizers: Dict[str, Any] = {}  # shipment -> tokenizer
_worker_lock = threading.Lock()


class _InlineBytes:
    """The model's bytes carried in the UDF's closure, where a session has no broadcast
    variables (Spark Connect: the closure travels in the plan, up to the server's gRPC
    message limit, spark.connect.grpc.maxInboundMessageSize, 128 MiB by default)."""

    def __init__(self, value: bytes):
        self.value = value


@dataclass(frozen=True)
class ShippedModel:
    """The model's bytes where the executors read them, and the key its workers keep it under.

    >>> shipped = Shipments().ship(spark, net, tokenizer=Encoder(tok))  # doctest: +SKIP
    >>> shipped.load(torch.device("cpu"))  # on an executor: the module, in eval mode  # doctest: +SKIP
    >>> shipped.tokenizer().encode(["the cat"])  # doctest: +SKIP
    [[4, 9]]
    """

    key: str
    carrier: Any  # a Broadcast, or _InlineBytes on Spark Connect
    tokenizer_carrier: Any = None

    def load(self, device: torch.device) -> torch.nn.Module:
        """Deserialize the model once per Python worker and device, and reuse it for every
        batch, task and transform() of this shipment; the oldest shipment's copies go (and
        their GPU memory with them)."""
        with _worker_lock:
            model = _worker_models.get((self.key, str(device)))
            if model is None:
                model = cloudpickle.loads(self.carrier.value)
                if isinstance(model, StoredFit):  # read from the fit's Store, straight onto the device
                    model = model.load(device)
                model.eval()
                model.to(device)
                while len(_worker_models) >= 2:
                    _evict(_worker_models.pop(next(iter(_worker_models))))
                _worker_models[(self.key, str(device))] = model
                _freeze_what_lives()
            return model

    def tokenizer(self) -> Any:
        """The tokenizer shipped with the weights, deserialized once per Python worker and kept
        for every task and transform() of this shipment (as long as its weights are)."""
        if self.tokenizer_carrier is None:
            raise ValueError("this shipment carries no tokenizer: ship(spark, model, tokenizer=...)")
        with _worker_lock:
            tokenizer = _worker_tokenizers.get(self.key)
            if tokenizer is None:
                tokenizer = cloudpickle.loads(self.tokenizer_carrier.value)
                for key in [k for k in _worker_tokenizers if k not in {s for s, _ in _worker_models}]:
                    del _worker_tokenizers[key]  # their shipments' weights are gone too
                _worker_tokenizers[self.key] = tokenizer
                _freeze_what_lives()
            return tokenizer


def _evict(model: torch.nn.Module) -> None:
    """Let an old shipment's model go (its GPU memory back to the device)."""
    on_gpu = next(iter(model.parameters()), torch.zeros(0)).is_cuda
    del model
    if on_gpu:
        torch.cuda.empty_cache()


def _freeze_what_lives() -> None:
    """Keep the worker's live objects (modules, the cached models) out of later collections,
    after collecting what the cache let go of (frozen objects are never collected)."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    logger.debug("froze %d objects out of this worker's garbage collections", gc.get_freeze_count())


def weights_version(model: torch.nn.Module) -> Tuple:
    """What changes when the module's weights do: each tensor's storage and in-place version
    (an optimizer step, load_state_dict or a no_grad update bumps it; a write through ``.data``
    does not, which is why the Model docs say to set the model anew after such a change)."""
    return tuple((name, t.data_ptr(), t._version) for name, t in model.state_dict(keep_vars=True).items())


class Shipments:
    """The last shipment of one fitted model's weights, reused by transform() calls on the same
    session while the weights are unchanged (a stream's micro-batches, a pipeline scored again).

    >>> shipments = Shipments(); a = shipments.ship(spark, net); b = shipments.ship(spark, net)  # doctest: +SKIP
    >>> a is b  # doctest: +SKIP
    True
    """

    def __init__(self) -> None:
        self._last: Optional[Tuple[Any, Any, Tuple, Any, ShippedModel]] = None
        self._lock = threading.Lock()

    def ship(self, spark, model: Union[torch.nn.Module, StoredFit], tokenizer: Any = None) -> ShippedModel:
        """The model's shipment for ``spark`` (with ``tokenizer``, any picklable object, where
        given): the last one if the weights are unchanged and the tokenizer is the same. A
        StoredFit ships its recipe and the weights' place: each executor reads the Store."""
        version = ("stored", model.weights.url) if isinstance(model, StoredFit) else weights_version(model)
        with self._lock:
            if self._last is not None:
                last_spark, last_model, last_version, last_tokenizer, shipped = self._last
                same_model = last_model is model or isinstance(model, StoredFit) and last_model == model
                if (last_spark is spark and same_model and last_version == version
                        and _same_tokenizer(last_tokenizer, tokenizer)):
                    return shipped
            data = to_bytes(model)
            tokenizer_data = None if tokenizer is None else cloudpickle.dumps(tokenizer)
            shipped = ShippedModel(uuid.uuid4().hex, _carrier(spark, data),
                                   None if tokenizer_data is None else _carrier(spark, tokenizer_data))
            logger.debug("shipped the model to the executors (%d bytes, a tokenizer of %d, key %s)", len(data),
                         len(tokenizer_data or b""), shipped.key)
            self._last = (spark, model, version, tokenizer, shipped)
            return shipped

    def __getstate__(self) -> Dict[str, Any]:
        return {}  # a pickled copy of the model ships its weights anew

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]


def _carrier(spark, data: bytes) -> Any:
    """Where the executors read ``data``: a broadcast, or the closure on Spark Connect."""
    from ..runner.driver.session import is_connect

    return _InlineBytes(data) if is_connect(spark) else spark.sparkContext.broadcast(data)


def _same_tokenizer(last: Any, new: Any) -> bool:
    """Whether ``new`` is the tokenizer ``last`` was (an Encoder decides for itself)."""
    return last is new or (isinstance(new, Encoder) and new.wraps_same_tokenizer(last))
