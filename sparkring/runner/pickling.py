"""Pickle what ships to the ranks, and when it cannot be pickled, name the attribute,
closure variable or global that fails (cloudpickle only says which type failed).

Written by hand: neither pickle nor cloudpickle reports the path to the failing object."""
from __future__ import annotations

import io
import sys
import types
from typing import Any, Dict, Iterator, List, Optional, Tuple

import cloudpickle

from ..errors import ConfigurationError

_MAX_DEPTH = 8


class _HostPickler(cloudpickle.Pickler):
    """cloudpickle that writes tensors held on a GPU (a model the driver trained or moved
    there, its optimizer's state) as CPU tensors: unpickled as they are, they would land on the
    driver's device number of every rank's GPU, or fail on ranks without one."""

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta"):
            if isinstance(obj, torch.nn.Parameter):
                return torch.nn.Parameter, (obj.detach().cpu(), obj.requires_grad)
            return _cpu_copy(obj).__reduce_ex__(self.proto)
        return super().reducer_override(obj)


def _cpu_copy(tensor):
    copy = tensor.detach().cpu()
    copy.requires_grad_(tensor.requires_grad and tensor.is_leaf)
    return copy


def to_bytes(obj: Any) -> bytes:
    """cloudpickle's bytes of ``obj`` with every GPU tensor in it written as a CPU tensor.

    >>> len(to_bytes({"w": torch.zeros(2)})) > 0  # doctest: +SKIP
    True
    """
    with io.BytesIO() as file:
        _HostPickler(file).dump(obj)
        return file.getvalue()


def dumps(obj: Any, named: Dict[str, Any]) -> bytes:
    """:func:`to_bytes` of ``obj``; where that fails, a ConfigurationError naming the part of
    ``named`` (the pieces ``obj`` is made of, by the names the user knows them by) that fails.

    >>> payload = dumps((fn, args), {"fn": fn, "args": args})  # doctest: +SKIP
    """
    try:
        return to_bytes(obj)
    except Exception as exc:  # noqa: BLE001 - pickling raises TypeError, PicklingError, AttributeError...
        raise ConfigurationError(unpicklable_message(named, exc)) from exc


def check_picklable(named: Dict[str, Any]) -> None:
    """Raise ConfigurationError naming the failing part if the objects cannot be shipped to the ranks.

    >>> check_picklable({"model": model, "loss": loss})  # doctest: +SKIP
    """
    dumps(tuple(named.values()), named)


def unpicklable_message(named: Dict[str, Any], exc: BaseException) -> str:
    """Say which part of the ``named`` objects cannot be pickled, and the ways out."""
    for name, obj in named.items():
        found = _find(obj, name, 0, set())
        if found is not None:
            where, kind, reason = found
            return (f"{name} cannot be pickled to ship it to the executors: {where} (a {kind}) fails with "
                    f"{reason!r}. Create it inside the function that runs on the ranks, drop it before "
                    "training, or make it picklable (__getstate__/__reduce__)")
    return f"what runs on the ranks cannot be pickled: {type(exc).__name__}: {exc}"


def _fails(obj: Any) -> Optional[str]:
    try:
        cloudpickle.dumps(obj)
        return None
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"


def _find(obj: Any, path: str, depth: int, seen: set) -> Optional[Tuple[str, str, str]]:
    """The deepest part of ``obj`` that fails on its own: (path, type name, error)."""
    reason = _fails(obj)
    if reason is None or id(obj) in seen:
        return None
    seen.add(id(obj))
    if depth < _MAX_DEPTH:
        for child_path, child in _parts(obj, path):
            found = _find(child, child_path, depth + 1, seen)
            if found is not None:
                return found
    return path, type(obj).__name__, reason


def _parts(obj: Any, path: str) -> Iterator[Tuple[str, Any]]:
    if isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            yield f"{path}[{i}]", item
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield f"{path}[{key!r}]", value
    elif isinstance(obj, types.FunctionType):
        yield from _function_parts(obj, path)
    elif isinstance(obj, types.MethodType):
        yield f"{path}.__self__", obj.__self__
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for key, value in vars(obj).items():
            if key in ("_modules", "_parameters", "_buffers") and isinstance(value, dict):
                # an nn.Module's children read as attributes: model.encoder, not model._modules['encoder']
                for name, child in value.items():
                    yield f"{path}.{name}", child
            else:
                yield f"{path}.{key}", value


def _function_parts(fn: types.FunctionType, path: str) -> Iterator[Tuple[str, Any]]:
    code = fn.__code__
    cells: List[Any] = list(fn.__closure__ or ())
    for name, cell in zip(code.co_freevars, cells):
        try:
            yield f"{path}'s closure variable {name!r}", cell.cell_contents
        except ValueError:  # an empty cell
            continue
    for name in _global_names(code):
        if name in fn.__globals__:
            yield f"{path}'s global {name!r}", fn.__globals__[name]
    for i, default in enumerate(fn.__defaults__ or ()):
        yield f"{path}'s default argument {i}", default


def _global_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # nested functions and comprehensions
            yield from _global_names(const)
