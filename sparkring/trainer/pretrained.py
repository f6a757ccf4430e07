"""Models that begin on storage: a factory's ``from_pretrained`` calls built empty (from the
checkpoint's config, under the meta device), ``initialWeights`` beside them, checked against the
stored names and shapes, and the stored values read into the module a placement built, each rank
reading only the tensors and slices it keeps.

transformers' ``from_pretrained`` loads every value into the process that calls it, and refuses to
run under the meta device, where the driver's checks and a sharded rank build a model. So while a
factory runs here (``deferred_from_pretrained``), ``PreTrainedModel.from_pretrained`` and the Auto
classes' build the model from its config with no values and note where the values lie; the
placement fills them after it has sharded or split the model (``fill``)."""
from __future__ import annotations

import contextlib
import io
import json
import logging
import sys
import threading
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import cloudpickle
import torch

from .config import is_factory
from .initialize import initialize_modules, plain_name
from .stored import CONFIG, Location, StoredTensors, StoredWeightsError

log = logging.getLogger(__name__)

# the patch is process-wide (a Tuner fits in threads): one factory at a time runs under it
_PATCH_LOCK = threading.RLock()
_local = threading.local()


@dataclass(frozen=True)
class WeightsSource:
    """Where a part of a model's values lie: ``location``'s names start at module path ``prefix``;
    ``strict``: every parameter there must be stored (initialWeights, a fit's weights), else the
    missing are initialized as ``from_pretrained`` does (a new classification head), and names are
    a pretrained checkpoint's (peft's wrapped ``base_layer`` is the checkpoint's layer itself).

    >>> WeightsSource(Location("/models/llama"), prefix="base_model.model.").prefix
    'base_model.model.'
    """

    location: Location
    prefix: str = ""
    strict: bool = False


@dataclass
class StoredModel:
    """A model whose values lie on storage: the module (built empty, its parameters on the meta
    device, unless the user passed a module) and where each part's values are.

    >>> stored = stored_model(lambda: AutoModelForCausalLM.from_pretrained("/models/llama"))  # doctest: +SKIP
    >>> stored.sources[0].location.path  # doctest: +SKIP
    '/models/llama'
    """

    module: torch.nn.Module
    sources: List[WeightsSource]
    _tensors: Dict[str, StoredTensors] = field(default_factory=dict, repr=False)

    @property
    def empty(self) -> bool:
        """Whether the module's parameters are still without values (on the meta device)."""
        return any(p.is_meta for p in self.module.parameters())

    def tensors(self, source: WeightsSource) -> StoredTensors:
        """What ``source`` holds (its headers read once)."""
        key = source.location.path
        if key not in self._tensors:
            self._tensors[key] = StoredTensors.at(source.location)
        return self._tensors[key]

    def __getstate__(self):
        return {**self.__dict__, "_tensors": {}}  # open files stay with the process that opened them


@contextlib.contextmanager
def deferred_from_pretrained(storage_options: Optional[Dict[str, Any]] = None,
                             import_transformers: bool = True) -> Iterator[List[Tuple[Any, str]]]:
    """While inside, ``from_pretrained`` of transformers' models (and Auto classes) builds the model
    empty from the checkpoint's config and records ``(module, path)`` in the yielded list (where
    transformers is not imported yet and ``import_transformers`` is False, only a
    HuggingFaceDirectory records itself: importing transformers costs seconds on every rank).

    >>> with deferred_from_pretrained() as calls, torch.device("meta"):  # doctest: +SKIP
    ...     model = AutoModelForCausalLM.from_pretrained("/models/llama")
    >>> calls[0][1]  # doctest: +SKIP
    '/models/llama'
    """
    with _PATCH_LOCK:
        calls: List[Tuple[Any, str]] = []
        saved = (getattr(_local, "calls", None), getattr(_local, "options", None))
        _local.calls, _local.options = calls, dict(storage_options or {})
        try:
            with _patched() if import_transformers or "transformers" in sys.modules else contextlib.nullcontext():
                yield calls
        finally:
            _local.calls, _local.options = saved


@contextlib.contextmanager
def _patched() -> Iterator[None]:
    try:
        from transformers import PreTrainedModel
        from transformers.models.auto.auto_factory import _BaseAutoModelClass
    except ImportError:
        yield
        return
    originals = (PreTrainedModel.__dict__["from_pretrained"], _BaseAutoModelClass.__dict__["from_pretrained"])
    PreTrainedModel.from_pretrained = classmethod(_empty_from_pretrained)  # type: ignore[method-assign, assignment]
    _BaseAutoModelClass.from_pretrained = classmethod(_empty_auto_from_pretrained)  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        PreTrainedModel.from_pretrained, _BaseAutoModelClass.from_pretrained = originals  # type: ignore


def _built_deferred(factory: Callable[[], Any], storage_options: Optional[Dict[str, Any]]
                    ) -> Tuple[Any, List[Tuple[Any, str]]]:
    """``factory()`` under the meta device with its from_pretrained calls deferred; transformers is
    patched only where it is imported already, or once the factory imported it (then built again)."""
    try:
        with deferred_from_pretrained(storage_options, import_transformers=False) as calls, torch.device("meta"):
            return factory(), calls
    except RuntimeError:
        if "transformers" not in sys.modules:
            raise
    with deferred_from_pretrained(storage_options) as calls, torch.device("meta"):
        return factory(), calls


def read_config(location: Location) -> Any:
    """The transformers config a checkpoint directory holds (its config.json), refused clearly where none."""
    from transformers import AutoConfig, PretrainedConfig

    if location.kind() != "directory":
        raise StoredWeightsError(f"{location.path} is not a Hugging Face checkpoint directory (it "
                                 f"{'does not exist' if location.kind() == 'missing' else 'is a file'})")
    if CONFIG not in location.names():
        raise StoredWeightsError(f"{location.path} has no {CONFIG}: a Hugging Face checkpoint directory holds the "
                                 "model's config beside its weights (save it with save_pretrained)")
    data = json.loads(location.child(CONFIG).read())
    model_type = data.pop("model_type", None)
    if model_type is None:
        return PretrainedConfig.from_dict(data)
    return AutoConfig.for_model(model_type, **data)


def _config_for(path: str, kwargs: Dict[str, Any]) -> Any:
    from transformers import PretrainedConfig

    config = kwargs.pop("config", None)
    if not isinstance(config, PretrainedConfig):
        config = read_config(Location(path, getattr(_local, "options", None)))
    for key in [k for k in kwargs if hasattr(config, k)]:  # from_pretrained's config overrides (num_labels=2)
        setattr(config, key, kwargs.pop(key))
    return config


def empty_pretrained(cls: Any, path: str, kwargs: Dict[str, Any]) -> torch.nn.Module:
    """``cls.from_pretrained(path, **kwargs)``'s model without its values (parameters on the meta
    device, in the dtype from_pretrained gives: ``dtype=`` where passed, else the stored one)."""
    kwargs = dict(kwargs)
    config = _config_for(path, kwargs)
    dtype = kwargs.pop("dtype", kwargs.pop("torch_dtype", "auto"))
    if dtype in (None, "auto"):
        dtype = getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    extra = {k: kwargs[k] for k in ("attn_implementation",) if k in kwargs}
    with torch.device("meta"):
        model = cls._from_config(config, dtype=dtype, **extra)
    return model.eval()  # as from_pretrained returns it


def _note(module: torch.nn.Module, path: str) -> torch.nn.Module:
    calls = getattr(_local, "calls", None)
    if calls is not None:
        calls.append((module, path))
    return module


def _empty_from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
    path = str(pretrained_model_name_or_path)
    return _note(empty_pretrained(cls, path, kwargs), path)


def _empty_auto_from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
    from transformers.models.auto.auto_factory import _get_model_class

    path = str(pretrained_model_name_or_path)
    config = _config_for(path, kwargs)
    model_class = _get_model_class(config, cls._model_mapping)
    return _note(empty_pretrained(model_class, path, {**kwargs, "config": config}), path)


class HuggingFaceDirectory:
    """``model="<a Hugging Face checkpoint directory or Store URL>"``: the architecture its config.json
    names, ``from_pretrained`` from there (built empty and filled by each rank where sparkring builds it).

    >>> HuggingFaceDirectory("/models/llama")().config.model_type  # doctest: +SKIP
    'llama'
    """

    def __init__(self, path: str, storage_options: Optional[Dict[str, Any]] = None):
        self.path, self.storage_options = str(path), dict(storage_options or {})

    def __repr__(self) -> str:
        return f"HuggingFaceDirectory({self.path!r})"

    def architecture(self) -> Any:
        """The transformers class the directory's config.json names (its first architecture)."""
        import transformers

        config = read_config(Location(self.path, self.storage_options))
        names = list(getattr(config, "architectures", None) or [])
        found = [getattr(transformers, n) for n in names if hasattr(transformers, n)]
        if not found:
            raise StoredWeightsError(f"{self.path}/{CONFIG} names no architecture transformers has "
                                     f"({names or 'no architectures'}): pass model=lambda: "
                                     "AutoModelFor...from_pretrained(path) instead")
        return found[0]

    def __call__(self) -> torch.nn.Module:
        """The model: empty and noted where sparkring builds it, else read whole onto the CPU."""
        if getattr(_local, "calls", None) is not None:
            _local.options = self.storage_options or _local.options
            return _note(empty_pretrained(self.architecture(), self.path, {}), self.path)
        with deferred_from_pretrained(self.storage_options):  # called by hand: the whole model, filled
            stored = stored_model(self, None, self.storage_options)
        assert stored is not None
        return materialized(stored, torch.device("cpu"))


def empty_model(factory: Callable[[], Any], initial_weights: Optional[str] = None,
                storage_options: Optional[Dict[str, Any]] = None) -> StoredModel:
    """What ``factory`` builds, empty (under the meta device; its ``from_pretrained`` calls deferred),
    with where its values lie (none: a plain factory without ``initialWeights``).

    >>> empty_model(lambda: torch.nn.Linear(2, 1)).module.weight.is_meta
    True
    """
    module, calls = _built_deferred(factory, storage_options)
    sources = []
    paths = {id(m): name for name, m in module.named_modules()} if isinstance(module, torch.nn.Module) else {}
    for part, path in calls:
        if id(part) in paths:  # a model the factory loaded and kept (not one it only read from)
            prefix = paths[id(part)]
            sources.append(WeightsSource(Location(path, storage_options), prefix + "." if prefix else ""))
    if initial_weights is not None:
        sources.append(WeightsSource(Location(initial_weights, storage_options), strict=True))
    return StoredModel(module, sources)


def stored_model(model: Any, initial_weights: Optional[str],
                 storage_options: Optional[Dict[str, Any]] = None) -> Optional[StoredModel]:
    """The model Param as a StoredModel where any of its values lie on storage (a factory that calls
    ``from_pretrained``, a checkpoint directory, ``initialWeights``); None where none do.

    >>> stored_model(lambda: torch.nn.Linear(2, 1), None) is None
    True
    """
    if not is_factory(model):
        if initial_weights is None:
            return None
        return StoredModel(model, [WeightsSource(Location(initial_weights, storage_options), strict=True)])
    stored = empty_model(model, initial_weights, storage_options)
    return stored if stored.sources else None


def stored_name(name: str, source: WeightsSource) -> Optional[str]:
    """The name a model's tensor ``name`` has in ``source`` (None where it lies outside the source's part).

    >>> stored_name("base_model.model.lm_head.base_layer.weight", WeightsSource(Location("d"), "base_model.model."))
    'lm_head.weight'
    """
    if not name.startswith(source.prefix):
        return None
    rest = plain_name(name[len(source.prefix):])
    return rest if source.strict else rest.replace("base_layer.", "")


def _entries(module: torch.nn.Module) -> List[Tuple[str, torch.Tensor]]:
    """The module's parameters and persistent buffers by name, a tied tensor under each of its names."""
    return list(module.state_dict(keep_vars=True).items())


def matches(stored: StoredModel) -> List[Tuple[WeightsSource, Dict[str, torch.Tensor]]]:
    """Per source, stored name -> the model's tensor it fills; refused (StoredWeightsError naming the
    file and the tensor) where a shape or dtype does not fit, or a strict source lacks a parameter."""
    out = []
    entries = _entries(stored.module)
    for source in stored.sources:
        info = stored.tensors(source).info
        offset = _stored_offset(entries, source, info)
        found: Dict[str, torch.Tensor] = {}
        missing = []
        for name, tensor in entries:
            mine = stored_name(name, source)
            if mine is None:
                continue
            key = offset + mine
            if key not in info:
                missing.append(name)
                continue
            _check_fits(info[key], key, name, tensor)
            found.setdefault(key, tensor)
        tied, by_name = {id(t) for t in found.values()}, dict(entries)
        missing = [name for name in missing if id(by_name[name]) not in tied]  # stored under a tied name
        _check_coverage(source, found, missing, sorted(info))
        out.append((source, found))
    return out


def _stored_offset(entries: List[Tuple[str, torch.Tensor]], source: WeightsSource, info: Dict[str, Any]) -> str:
    """The prefix a checkpoint adds to the model's names: none, or "model." (a sparkring DCP checkpoint)."""
    names = [n for n in (stored_name(name, source) for name, _ in entries) if n is not None]
    return max(("", "model."), key=lambda p: sum(p + n in info for n in names))


def _check_fits(info: Any, key: str, name: str, tensor: torch.Tensor) -> None:
    if tuple(info.shape) != tuple(tensor.shape):
        raise StoredWeightsError(f"{info.file}: tensor {key!r} is {list(info.shape)}, but the model's {name!r} is "
                                 f"{list(tensor.shape)}: the checkpoint is of another model configuration")
    if tensor.is_floating_point() and not info.dtype.is_floating_point:
        raise StoredWeightsError(f"{info.file}: tensor {key!r} is stored as {info.dtype} (quantized?), which the "
                                 f"model's {tensor.dtype} parameter {name!r} cannot hold: store it dequantized")


def _check_coverage(source: WeightsSource, found: Dict[str, Any], missing: List[str], stored: List[str]) -> None:
    where = source.location.path
    if not found:
        raise StoredWeightsError(f"none of the model's tensors is in {where}: it holds {stored[:5]}..., the model "
                                 f"has {missing[:5]}...; is it the checkpoint of another model?")
    if source.strict and missing:
        raise StoredWeightsError(f"initialWeights {where} lacks {len(missing)} of the model's tensors, e.g. "
                                 f"{missing[:5]}: store every parameter, or load the rest in the factory")
    if missing:
        log.info("%d tensors are not in %s and start as initialized (e.g. %s)", len(missing), where, missing[:3])


def covered_names(stored: StoredModel) -> Set[str]:
    """The names (without wrappers' parts) of the model's tensors that stored values fill."""
    out: Set[str] = set()
    entries = _entries(stored.module)
    for source in stored.sources:
        info = stored.tensors(source).info
        offset = _stored_offset(entries, source, info)
        out |= {plain_name(name) for name, _ in entries
                if (mine := stored_name(name, source)) is not None and offset + mine in info}
    return out


def fill(stored: StoredModel, module: Optional[torch.nn.Module] = None) -> None:
    """Read the stored values into ``module`` (default: the stored model's own, as its placement left
    it: sharded or split tensors get only this rank's slices read)."""
    target = StoredModel(module if module is not None else stored.module, stored.sources, stored._tensors)
    with torch.no_grad():
        for source, found in matches(target):
            tensors = target.tensors(source)
            if tensors.form == "dcp":
                tensors.load_dcp({k: t.detach() for k, t in found.items()})
                continue
            for key, tensor in found.items():
                _copy_in(tensor, tensors, key)


def _copy_in(tensor: torch.Tensor, tensors: StoredTensors, key: str) -> None:
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = tensor.to_local()
        if local.numel() == 0:
            return
        shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
        local.copy_(tensors.read(key, index).reshape(local.shape))
        return
    tensor.copy_(tensors.read(key))


def retie(module: torch.nn.Module) -> None:
    """Tie what a Hugging Face model ties again (materializing an empty model unties shared parameters)."""
    for part in module.modules():
        tie = getattr(part, "tie_weights", None)
        if callable(tie) and hasattr(part, "config"):
            tie()


def _zero(part: torch.nn.Module) -> None:
    for parameter in part.parameters(recurse=False):
        torch.nn.init.zeros_(parameter)


def initializer(module: torch.nn.Module, init_fn: Optional[Callable[[torch.nn.Module], None]]
                ) -> Callable[[str, torch.nn.Module], Optional[Callable[[], None]]]:
    """How each module of ``module`` gets its initial values: ``init_fn``, its ``reset_parameters()``,
    or the Hugging Face model holding it (``_init_weights``, as from_pretrained initializes what a
    checkpoint lacks, rotary tables included); None where there is no way."""
    owners: Dict[int, Any] = {}
    for part in module.modules():  # outermost first: an inner model's own rule wins
        if hasattr(part, "_init_weights") and hasattr(part, "config"):
            for inner in part.modules():
                owners[id(inner)] = part

    def how(name: str, part: torch.nn.Module) -> Optional[Callable[[], None]]:
        if init_fn is not None:
            return lambda: init_fn(part)
        if ".lora_B." in f".{name}." or ".lora_embedding_B" in f".{name}":
            return lambda: _zero(part)  # peft: an adapter changes nothing at first
        reset = getattr(part, "reset_parameters", None)
        if callable(reset):
            return reset
        owner = owners.get(id(part))
        return (lambda: owner._init_weights(part)) if owner is not None else None

    return how


def to_empty(module: torch.nn.Module, device: torch.device, tie: bool = True) -> Set[str]:
    """Give ``module``'s meta tensors uninitialized storage on ``device`` (a whole model's ties made
    again: not a sharded one's, whose units FSDP2 made), keeping the values of buffers that had some
    (a skeleton's); the names of those kept."""
    real = {n: b.detach().clone() for n, b in module.named_buffers() if not b.is_meta}
    module.to_empty(device=device)
    if tie:
        retie(module)
    with torch.no_grad():
        for name, value in real.items():
            module.get_buffer(name).copy_(value)
    return {plain_name(n) for n in real}


def materialized(stored: StoredModel, device: torch.device, seed: int = 0,
                 init_fn: Optional[Callable[[torch.nn.Module], None]] = None,
                 values: Optional[Dict[str, torch.Tensor]] = None,
                 part: Optional[torch.nn.Module] = None) -> torch.nn.Module:
    """The whole model on ``device`` (or only ``part``: a module holding some of the model's own
    modules under their names, such as a pipeline rank's stages): what the storage (or ``values``, a
    state dict in hand) lacks initialized from ``seed`` (rotary tables, new heads), then filled.

    >>> materialized(stored_model(factory, None), torch.device("cpu")).lm_head.weight.is_meta  # doctest: +SKIP
    False
    """
    module = part if part is not None else stored.module
    if stored.empty:
        filled = set(values) if values is not None else covered_names(replace(stored, module=module))
        filled |= to_empty(module, device, tie=part is None)
        initialize_modules(module, seed, initializer(stored.module, init_fn), skip=filled)
    else:
        module = module.to(device)
    if values is not None:
        module.load_state_dict(values)
    else:
        fill(stored, module)
    return module


def _meta_parameter(shape: Tuple[int, ...], dtype: torch.dtype, requires_grad: bool) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=requires_grad)


class _SkeletonPickler(cloudpickle.Pickler):
    """Pickles a module with its parameters as meta tensors (shape, dtype, requires_grad: no values)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.nn.Parameter):
            return _meta_parameter, (tuple(obj.shape), obj.dtype, obj.requires_grad)
        return super().reducer_override(obj)


def skeleton_bytes(module: torch.nn.Module) -> bytes:
    """``module`` pickled without its parameters' values (kilobytes whatever its size; buffers kept).

    >>> len(skeleton_bytes(torch.nn.Linear(1000, 1000))) < 10_000
    True
    """
    buf = io.BytesIO()
    _SkeletonPickler(buf).dump(module)
    return buf.getvalue()


def skeleton(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module`` whose parameters are on the meta device (tied ones still tied).

    >>> skeleton(torch.nn.Linear(2, 1)).weight.is_meta
    True
    """
    return cloudpickle.loads(skeleton_bytes(module))
