"""Store: where a run keeps its data, checkpoints, logs and model (local paths or URLs)."""
from __future__ import annotations

import atexit
import logging
import os
import posixpath
import re
import shutil
import tempfile
import time
import uuid
from typing import Any, Dict, List, Optional

import pyarrow.fs as pafs

from ..errors import ConfigurationError, StoreError

log = logging.getLogger(__name__)
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_run_id(run_id: str) -> None:
    """A run id names one directory under the store's ``runs/``: letters, digits, '.', '_', '-'.

    >>> check_run_id("../escape")
    Traceback (most recent call last):
    ...
    sparkring.errors.ConfigurationError: runId='../escape' ...
    """
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id) or ".." in run_id:
        raise ConfigurationError(f"runId={run_id!r} is not a plain name: use letters, digits, '.', '_' and '-' "
                                 "(up to 128, no '/' or '..'); it names a directory under the store's runs/")


# pyarrow's and fsspec's (s3fs, gcsfs, adlfs) object store filesystems
_OBJECT_STORES = ("S3FileSystem", "GcsFileSystem", "GCSFileSystem", "AzureFileSystem", "AzureBlobFileSystem")
OBJECT_STORE_RETRIES = (1.0, 2.0)  # seconds before the second and third attempt of a write


def open_filesystem(url: str, storage_options: Optional[Dict[str, Any]] = None):
    """The pyarrow filesystem of ``url`` (pyarrow's own, else fsspec's) and the path in it."""
    if not storage_options:
        try:
            return pafs.FileSystem.from_uri(url)
        except Exception:  # noqa: BLE001 - a scheme pyarrow does not know: fsspec may
            pass
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path


def _remove_if_mine(path: str, owner: int) -> None:
    """At exit: a temporary store goes with the process that made it (not with a forked child)."""
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)


class Store:
    """A directory (local path or any URL pyarrow.fs or fsspec opens) holding runs:
    ``runs/<run_id>/{data,checkpoints,logs,model}``.

    ``Store()`` makes a temporary local directory, removed when the interpreter exits.

    >>> store = Store("file:///tmp/sparkring")
    >>> store.run_path("r1", "checkpoints")
    '/tmp/sparkring/runs/r1/checkpoints'
    >>> Store("s3://bucket/runs", storage_options={"anon": False})  # doctest: +SKIP
    """

    def __init__(self, path_or_url: Optional[str] = None, storage_options: Optional[Dict[str, Any]] = None):
        self._temporary = path_or_url is None
        if self._temporary:
            path_or_url = tempfile.mkdtemp(prefix="sparkring-store-")
            atexit.register(_remove_if_mine, path_or_url, os.getpid())
        path_or_url = str(path_or_url)
        if path_or_url.startswith("file:/") and not path_or_url.startswith("file://"):
            path_or_url = "file://" + path_or_url[len("file:"):]  # Hadoop's file:/tmp/x, as Spark users write it
        if "://" not in path_or_url:
            path_or_url = os.path.abspath(os.path.expanduser(path_or_url))
        self.url = path_or_url
        self.storage_options = dict(storage_options or {})
        self._fs: Optional[pafs.FileSystem] = None
        self._root: Optional[str] = None

    # pickles as its URL: filesystems reconnect lazily on the ranks
    def __getstate__(self):
        return {"url": self.url, "storage_options": self.storage_options, "_temporary": self._temporary}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._fs = None
        self._root = None

    def __repr__(self):
        return f"Store({self.url!r})"

    def __eq__(self, other):
        return isinstance(other, Store) and (self.url, self.storage_options) == (other.url, other.storage_options)

    def __hash__(self):
        return hash(self.url)

    @property
    def is_temporary(self) -> bool:
        """Whether sparkring made the store's directory (and removes it)."""
        return self._temporary

    @property
    def is_object_store(self) -> bool:
        """S3, GCS or Azure: no directories and no rename (a PUT is all or nothing)."""
        fs = self.fs
        inner = fs.handler.fs if isinstance(fs, pafs.PyFileSystem) and hasattr(fs.handler, "fs") else fs
        return type(fs).__name__ in _OBJECT_STORES or type(inner).__name__ in _OBJECT_STORES

    @property
    def is_local(self) -> bool:
        """Whether the store is on this machine's file system."""
        return isinstance(self.fs, pafs.LocalFileSystem)

    @property
    def fs(self) -> pafs.FileSystem:
        """The pyarrow file system the store's URL names (resolved once)."""
        if self._fs is None:
            if "://" in self.url:
                try:
                    self._fs, self._root = open_filesystem(self.url, self.storage_options)
                except (ValueError, ImportError) as exc:  # an unknown scheme, or its package is missing
                    scheme = self.url.split("://", 1)[0]
                    raise StoreError(f"store {self.url!r}: the scheme {scheme!r} cannot be opened ({exc}); use a "
                                     "local path, file://, hdfs:// or a scheme an installed fsspec package "
                                     "serves (s3fs for s3://, gcsfs for gs://, adlfs for abfs://)") from exc
            else:
                self._fs, self._root = pafs.LocalFileSystem(), self.url
            self._root = (self._root or "").rstrip("/") or "/"
        return self._fs

    @property
    def root(self) -> str:
        """The store's root: its path within fs."""
        self.fs  # noqa: B018 - resolves the root
        assert self._root is not None
        return self._root

    def path(self, *parts: str) -> str:
        """Path inside the filesystem of the store (not a URL)."""
        return posixpath.join(self.root, *parts)

    def run_path(self, run_id: str, *parts: str) -> str:
        """A path in the directory of the run ``run_id``."""
        check_run_id(run_id)
        return self.path("runs", run_id, *parts)

    def data_path(self, run_id: str, *parts: str) -> str:
        """A path where run ``run_id``'s materialized data lives."""
        return self.run_path(run_id, "data", *parts)

    def checkpoint_path(self, run_id: str, *parts: str) -> str:
        """A path where run ``run_id``'s checkpoints live."""
        return self.run_path(run_id, "checkpoints", *parts)

    def checkpoint_url(self, run_id: str, *parts: str) -> str:
        """The URL (not a path in ``fs``) of a file beside the run's checkpoints, for fsspec."""
        check_run_id(run_id)
        return posixpath.join(self.url, "runs", run_id, "checkpoints", *parts)

    def logs_path(self, run_id: str, *parts: str) -> str:
        """A path where run ``run_id``'s logs live."""
        return self.run_path(run_id, "logs", *parts)

    def model_path(self, run_id: str, *parts: str) -> str:
        """A path where run ``run_id``'s fitted weights live."""
        return self.run_path(run_id, "model", *parts)

    def url_of(self, path: str) -> str:
        """The URL (or local path) of ``path`` in the store's filesystem, for readers outside the Store.

        >>> Store("/tmp/s").url_of(Store("/tmp/s").model_path("r1"))
        '/tmp/s/runs/r1/model'
        """
        if not path.startswith(self.root) or "://" not in self.url:
            return path
        return posixpath.join(self.url, path[len(self.root):].lstrip("/"))

    def local_path(self, path: str) -> Optional[str]:
        """The OS path of ``path`` when the store is on the local disk, else None."""
        return path if self.is_local else None

    # -- file operations --------------------------------------------------------------
    def exists(self, path: str) -> bool:
        """Whether ``path`` exists."""
        return self.fs.get_file_info(path).type != pafs.FileType.NotFound

    def makedirs(self, path: str) -> None:
        """Make the directory ``path`` and its parents."""
        self.fs.create_dir(path, recursive=True)

    def listdir(self, path: str) -> List[str]:
        """The names in the directory ``path``, sorted (none where it does not exist)."""
        info = self.fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
        return sorted(posixpath.basename(i.path) for i in info)

    def read_bytes(self, path: str) -> bytes:
        """The whole file ``path``."""
        with self.fs.open_input_stream(path) as f:
            return f.read()

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write so that no reader ever sees a partial file: a temporary name then a rename;
        on object stores a single PUT is already all-or-nothing (and one that fails is tried
        again, ``OBJECT_STORE_RETRIES`` times: a store that is back within seconds loses nothing)."""
        parent = posixpath.dirname(path)
        if self.is_object_store:
            for attempt, pause in enumerate((*OBJECT_STORE_RETRIES, None)):
                try:
                    with self.fs.open_output_stream(path) as f:
                        f.write(data)
                    return
                except Exception as exc:  # noqa: BLE001 - every backend raises its own type
                    if pause is None:
                        raise StoreError(f"the store {self.url} could not be written at {path} after "
                                         f"{attempt + 1} attempts ({exc})") from exc
                    log.warning("writing %s to the store %s failed (%s); trying again in %.0f s",
                                path, self.url, exc, pause)
                    time.sleep(pause)
        self.makedirs(parent)
        tmp = posixpath.join(parent, f".{posixpath.basename(path)}.{uuid.uuid4().hex}.tmp")
        with self.fs.open_output_stream(tmp) as f:
            f.write(data)
        self.fs.move(tmp, path)

    def delete(self, path: str) -> None:
        """Remove ``path``: a file, or a directory with all it holds."""
        info = self.fs.get_file_info(path)
        if info.type == pafs.FileType.Directory:
            self.fs.delete_dir(path)
        elif info.type == pafs.FileType.File:
            self.fs.delete_file(path)

    def check_writable(self) -> None:
        """Raise StoreError naming the store when a file cannot be created in it."""
        probe = self.path(f".sparkring-write-check-{uuid.uuid4().hex}")
        try:
            self.makedirs(self.root)
            self.write_bytes(probe, b"ok")
            self.delete(probe)
        except Exception as exc:  # noqa: BLE001 - every backend raises its own type
            raise StoreError(f"the store {self.url} is not writable ({exc}); pass "
                             "store=Store(<a directory or URL you can write to>)") from exc
