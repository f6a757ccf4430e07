"""Weights on storage, read by name and by slice: a Hugging Face directory, safetensors files, a DCP
checkpoint directory or a torch state-dict file, local or behind a URL.

Written by hand over safetensors' ``get_slice`` (a slice of one tensor read from the file, nothing
else) and DCP's planner run without collectives (``no_dist``: a pipeline stage or a tensor-parallel
rank asks for other names and slices than its peers): transformers' loading fills only the modules
it builds itself, and a rank here fills the shards its placement made."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
import tempfile
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..data.store import open_filesystem

log = logging.getLogger(__name__)

CONFIG = "config.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"
DCP_METADATA = ".metadata"
_HEADER_LIMIT = 100 * 2 ** 20  # safetensors' own limit on a header's size


class StoredWeightsError(ValueError):
    """Stored weights that cannot be read into the model (no weights, a name or shape that does not match)."""


@dataclass(frozen=True)
class TensorInfo:
    """One stored tensor's shape and dtype, and the file that holds it."""

    shape: Tuple[int, ...]
    dtype: torch.dtype
    file: str


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                       "F8_E5M2": torch.float8_e5m2}


def _join(base: str, name: str) -> str:
    return posixpath.join(base.rstrip("/"), name) if "://" in base else os.path.join(base, name)


class Location:
    """A file or directory on storage (``path`` local or a URL, with the Store's ``storage_options``).

    >>> Location("/models/llama").child("config.json").path
    '/models/llama/config.json'
    """

    def __init__(self, path: str, storage_options: Optional[Dict[str, Any]] = None):
        self.path, self.storage_options = str(path), dict(storage_options or {})
        self._fs: Any = None

    def __repr__(self) -> str:
        return f"Location({self.path!r})"

    def __getstate__(self):
        return {**self.__dict__, "_fs": None}  # a filesystem is opened again where it is used

    @property
    def is_local(self) -> bool:
        """Whether the location is on this machine's filesystem (a path or file://)."""
        return "://" not in self.path or self.path.startswith("file://")

    def child(self, name: str) -> "Location":
        """The entry ``name`` of this directory."""
        return Location(_join(self.path, name), self.storage_options)

    def _filesystem(self) -> Tuple[Any, str]:
        if self._fs is None:
            self._fs = open_filesystem(self.path, self.storage_options)
        return self._fs

    def kind(self) -> str:
        """'file', 'directory' or 'missing'."""
        import pyarrow.fs as pafs

        fs, path = self._filesystem()
        info = fs.get_file_info(path)
        return {pafs.FileType.File: "file", pafs.FileType.Directory: "directory"}.get(info.type, "missing")

    def names(self) -> List[str]:
        """The names of a directory's entries."""
        import pyarrow.fs as pafs

        fs, path = self._filesystem()
        return sorted(posixpath.basename(i.path) for i in fs.get_file_info(pafs.FileSelector(path)))

    def read(self, start: int = 0, length: Optional[int] = None) -> bytes:
        """``length`` bytes from ``start`` (to the end where None)."""
        fs, path = self._filesystem()
        with fs.open_input_file(path) as f:
            f.seek(start)
            return f.read(length) if length is not None else f.read()

    def local_file(self) -> str:
        """A local path to the file: itself, or a copy in this host's cache (one per URL and size)."""
        if self.is_local:
            return self.path[len("file://"):] if self.path.startswith("file://") else self.path
        fs, path = self._filesystem()
        size = fs.get_file_info(path).size
        key = hashlib.sha256(f"{self.path}:{size}".encode()).hexdigest()[:24]
        target = os.path.join(tempfile.gettempdir(), "sparkring-weights", key, posixpath.basename(path))
        if not os.path.exists(target):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            partial = f"{target}.{os.getpid()}.part"
            with fs.open_input_stream(path) as src, open(partial, "wb") as out:
                while chunk := src.read(64 * 2 ** 20):
                    out.write(chunk)
            os.replace(partial, target)  # ranks of one host copying at once: the last complete copy wins
        return target


def safetensors_header(location: Location) -> Dict[str, TensorInfo]:
    """The tensors a safetensors file holds, from its header alone (8 bytes of length, then JSON)."""
    head = location.read(0, 8)
    size = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 0 < size < _HEADER_LIMIT:
        raise StoredWeightsError(f"{location.path} is not a safetensors file (its header is unreadable)")
    header = json.loads(location.read(8, size))
    header.pop("__metadata__", None)
    return {name: TensorInfo(tuple(meta["shape"]), _SAFETENSORS_DTYPES.get(meta["dtype"], torch.uint8),
                             location.path) for name, meta in header.items()}


class StoredTensors:
    """The tensors stored at one location, by name; ``read`` gives a tensor or a slice of it.

    >>> tensors = StoredTensors.at(Location("/models/llama"))  # doctest: +SKIP
    >>> tensors.info["lm_head.weight"].shape  # doctest: +SKIP
    (32000, 2048)
    """

    def __init__(self, location: Location, info: Dict[str, TensorInfo], form: str):
        self.location, self.info, self.form = location, info, form
        self._open: Dict[str, Any] = {}
        self._torch_state: Optional[Dict[str, torch.Tensor]] = None

    @classmethod
    def at(cls, location: Location) -> "StoredTensors":
        """What ``location`` holds, read from headers and indexes only (no tensor data)."""
        kind = location.kind()
        if kind == "missing":
            raise StoredWeightsError(f"{location.path} does not exist")
        if kind == "file":
            if location.path.endswith(".safetensors"):
                return cls(location, safetensors_header(location), "safetensors")
            return cls._torch_file(location)
        names = location.names()
        if DCP_METADATA in names:
            return cls._dcp(location)
        files = [n for n in names if n.endswith(".safetensors")]
        if SAFETENSORS_INDEX in names:
            index = json.loads(location.child(SAFETENSORS_INDEX).read())["weight_map"]
            files = sorted(set(index.values()))
        if not files:
            raise StoredWeightsError(
                f"{location.path} holds no weights: no *.safetensors file (nor {SAFETENSORS_INDEX}) and no DCP "
                f"checkpoint ({DCP_METADATA}); it has {names[:10]}. Save the model with save_pretrained(..., "
                "safe_serialization=True)")
        info: Dict[str, TensorInfo] = {}
        for name in files:
            info.update(safetensors_header(location.child(name)))
        return cls(location, info, "safetensors")

    @classmethod
    def _torch_file(cls, location: Location) -> "StoredTensors":
        state = _state_dict_in(torch.load(location.local_file(), map_location="cpu", mmap=True, weights_only=True),
                               location.path)
        stored = cls(location, {n: TensorInfo(tuple(t.shape), t.dtype, location.path) for n, t in state.items()},
                     "torch")
        stored._torch_state = state
        return stored

    @classmethod
    def _dcp(cls, location: Location) -> "StoredTensors":
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        metadata = _dcp_reader(location).read_metadata()
        info = {n: TensorInfo(tuple(m.size), m.properties.dtype, location.path)
                for n, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
        return cls(location, info, "dcp")

    def read(self, name: str, index: Optional[Tuple[slice, ...]] = None) -> torch.Tensor:
        """Tensor ``name`` (the part ``index`` selects), read from storage."""
        if self.form == "torch":
            assert self._torch_state is not None
            value = self._torch_state[name]
            return (value[index] if index else value).clone()
        from safetensors import safe_open

        file = self.info[name].file
        if file not in self._open:
            self._open[file] = safe_open(Location(file, self.location.storage_options).local_file(), "pt")
        if not index:
            return self._open[file].get_tensor(name)
        return self._open[file].get_slice(name)[index]

    def load_dcp(self, targets: Dict[str, torch.Tensor]) -> None:
        """Fill ``targets`` (stored name -> this rank's tensor or DTensor) from a DCP checkpoint, reading
        only this rank's slices, without collectives (each rank may ask for other names)."""
        import torch.distributed.checkpoint as dcp

        dcp.load(targets, storage_reader=_dcp_reader(self.location), no_dist=True)


def _dcp_reader(location: Location):
    import torch.distributed.checkpoint as dcp

    if location.is_local:
        return dcp.FileSystemReader(location.local_file())
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(location.path, **location.storage_options)


def _state_dict_in(loaded: Any, path: str) -> Dict[str, torch.Tensor]:
    """The state dict a torch file holds: the file itself, or under "state_dict" / "model" as trainers save it."""
    for key in ("state_dict", "model"):
        if isinstance(loaded, dict) and isinstance(loaded.get(key), dict):
            loaded = loaded[key]
            break
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise StoredWeightsError(f"{path} holds no state dict of tensors "
                                 "(torch.save(model.state_dict(), path) makes one)")
    return loaded

