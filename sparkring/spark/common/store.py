"""Horovod's Store classes (``Store.create``, ``FilesystemStore``, ``LocalStore``, ``HDFSStore``)
over sparkring's Store, with Horovod's path methods and layout: ``<prefix>/runs/<run_id>`` holds a
run (sparkring's checkpoints, logs and model inside it), ``<prefix>/intermediate_train_data`` the
training data ``util.prepare_data`` writes.

Paths these methods return are URLs (``file:///...``, ``hdfs://...``) as Horovod's are; every
method takes a URL or a path in the store's filesystem alike.

>>> store = Store.create("/tmp/horovod-store")
>>> store.get_checkpoint_path("run01")
'file:///tmp/horovod-store/runs/run01'
"""
from __future__ import annotations

import logging
import pathlib
import posixpath
from typing import Any, Dict, List, Optional

import pyarrow.parquet as pq

from ...data import Store as SparkRingStore
from ...data.store import check_run_id

log = logging.getLogger(__name__)


def _as_url(prefix_path: str) -> str:
    """Horovod's full path: a local path becomes a file:// URI; a URL stays."""
    if "://" in prefix_path:
        return prefix_path.rstrip("/")
    return pathlib.Path(prefix_path).expanduser().absolute().as_uri()


class Store(SparkRingStore):
    """Horovod's ``horovod.spark.common.store.Store``: a sparkring Store with Horovod's methods.

    ``Store.create(prefix_path)`` picks the class from the path (``hdfs://`` gives an HDFSStore,
    anything else a FilesystemStore). ``runs_path``, ``train_path``, ``val_path`` and ``test_path``
    move those directories; ``save_runs=False`` keeps no run directory for checkpoints.

    >>> store = Store.create("file:///tmp/runs-here")
    >>> store.get_run_path("r1")
    'file:///tmp/runs-here/runs/r1'
    """

    def __init__(self, prefix_path: str, train_path: Optional[str] = None, val_path: Optional[str] = None,
                 test_path: Optional[str] = None, runs_path: Optional[str] = None, save_runs: bool = True,
                 storage_options: Optional[Dict[str, Any]] = None, checkpoint_filename: Optional[str] = None,
                 **ignored: Any):
        self.prefix_path = _as_url(str(prefix_path))
        super().__init__(self.prefix_path, storage_options=storage_options)
        self._train_path = self._full(train_path, "intermediate_train_data")
        self._val_path = self._full(val_path, "intermediate_val_data")
        self._test_path = self._full(test_path, "intermediate_test_data")
        self._runs_path = self._full(runs_path, "runs")
        self._save_runs = save_runs
        self.checkpoint_filename = checkpoint_filename or "checkpoint"
        if ignored:
            log.info("Store keyword(s) %s accepted and not used", sorted(ignored))

    @staticmethod
    def create(prefix_path: str, *args: Any, **kwargs: Any) -> "Store":
        """Horovod's factory: an HDFSStore for ``hdfs://`` paths, a FilesystemStore otherwise.

        >>> Store.create("/tmp/horovod")  # doctest: +SKIP
        FilesystemStore('file:///tmp/horovod')
        """
        if HDFSStore.matches(prefix_path):
            return HDFSStore(prefix_path, *args, **kwargs)
        return FilesystemStore(prefix_path, *args, **kwargs)

    # pickles as its URLs, like sparkring's Store: the ranks reconnect lazily
    def __getstate__(self):
        return {**super().__getstate__(), **{k: v for k, v in self.__dict__.items()
                                             if k in ("prefix_path", "_train_path", "_val_path", "_test_path",
                                                      "_runs_path", "_save_runs", "checkpoint_filename")}}

    def __repr__(self):
        return f"{type(self).__name__}({self.prefix_path!r})"

    def _full(self, path: Optional[str], default: str) -> str:
        return _as_url(str(path)) if path is not None else posixpath.join(self.prefix_path, default)

    def get_localized_path(self, path: str) -> str:
        """``path`` (a URL or a path) as a path in the store's filesystem."""
        if path.startswith(self.prefix_path):
            rest = path[len(self.prefix_path):].lstrip("/")
            return self.path(rest) if rest else self.root
        if "://" in path:
            return SparkRingStore(path, self.storage_options).root
        return path

    def get_full_path(self, path: str) -> str:
        """``path`` as a URL (a path in the store's filesystem gets the store's scheme)."""
        return self.url_of(path) if "://" not in path and "://" in self.url else _as_url(path)

    # -- sparkring's layout, under Horovod's runs path ------------------------------
    def run_path(self, run_id: str, *parts: str) -> str:
        """A path in the run's directory: ``<runs_path>/<run_id>`` (sparkring's files inside it)."""
        check_run_id(run_id)
        return posixpath.join(self.get_localized_path(self._runs_path), run_id, *parts)

    def checkpoint_url(self, run_id: str, *parts: str) -> str:
        """The URL of a file beside the run's checkpoints, for fsspec."""
        return posixpath.join(self._runs_path, run_id, "checkpoints", *parts)

    # -- Horovod's methods ------------------------------------------------------------
    def exists(self, path: str) -> bool:
        """Whether ``path`` (a URL or a path in the store) exists."""
        return super().exists(self.get_localized_path(path))

    def read(self, path: str) -> bytes:
        """The whole file ``path``."""
        return self.read_bytes(self.get_localized_path(path))

    def write_text(self, path: str, text: str) -> None:
        """Write ``text`` to ``path`` (readers never see half of it)."""
        self.write_bytes(self.get_localized_path(path), text.encode())

    def is_parquet_dataset(self, path: str) -> bool:
        """Whether ``path`` is the root of a Parquet dataset."""
        try:
            return self.get_parquet_dataset(path) is not None
        except Exception:  # noqa: BLE001 - whatever pyarrow raises for "not a dataset"
            return False

    def get_parquet_dataset(self, path: str) -> pq.ParquetDataset:
        """The Parquet dataset at ``path``."""
        return pq.ParquetDataset(self.get_localized_path(path), filesystem=self.fs)

    def get_train_data_path(self, idx: Optional[Any] = None) -> str:
        """Where ``util.prepare_data`` writes the training rows (``.idx`` for the idx-th dataset)."""
        return f"{self._train_path}.{idx}" if idx is not None else self._train_path

    def get_val_data_path(self, idx: Optional[Any] = None) -> str:
        """Where ``util.prepare_data`` writes the validation rows."""
        return f"{self._val_path}.{idx}" if idx is not None else self._val_path

    def get_test_data_path(self, idx: Optional[Any] = None) -> str:
        """Where test rows would go (Horovod's name; sparkring's estimators write none)."""
        return f"{self._test_path}.{idx}" if idx is not None else self._test_path

    def saving_runs(self) -> bool:
        """Whether runs keep a directory (``save_runs``)."""
        return self._save_runs

    def get_runs_path(self) -> str:
        """The directory of every run."""
        return self._runs_path

    def get_run_path(self, run_id: str) -> str:
        """The run's directory."""
        return posixpath.join(self._runs_path, run_id)

    def get_checkpoint_path(self, run_id: str) -> Optional[str]:
        """The run's directory, where its checkpoints go (None with ``save_runs=False``)."""
        return self.get_run_path(run_id) if self._save_runs else None

    def get_checkpoints(self, run_id: str, suffix: str = ".ckpt") -> List[str]:
        """The run's checkpoint files ending in ``suffix``, sorted (its directory and sparkring's
        ``checkpoints/`` inside it)."""
        found = []
        for sub in ("", "checkpoints"):
            directory = self.run_path(run_id, sub) if sub else self.run_path(run_id)
            found += [posixpath.join(directory, name) for name in self.listdir(directory) if name.endswith(suffix)]
        return sorted(self.get_full_path(p) for p in found)

    def get_logs_path(self, run_id: str) -> Optional[str]:
        """The run's logs directory (None with ``save_runs=False``)."""
        return posixpath.join(self.get_run_path(run_id), self.get_logs_subdir()) if self._save_runs else None

    def get_checkpoint_filename(self) -> str:
        """The checkpoint's file name (``checkpoint_filename``)."""
        return self.checkpoint_filename

    def get_logs_subdir(self) -> str:
        """The logs directory's name inside a run."""
        return "logs"


class FilesystemStore(Store):
    """Horovod's FilesystemStore: any path or URL fsspec or pyarrow opens (local, s3://, gs://, ...).

    >>> FilesystemStore("/tmp/horovod").get_train_data_path()  # doctest: +SKIP
    'file:///tmp/horovod/intermediate_train_data'
    """

    @classmethod
    def matches(cls, path: str) -> bool:
        """Any path."""
        return True


class LocalStore(FilesystemStore):
    """Horovod's LocalStore (a FilesystemStore on a local directory, as in Horovod since 0.22).

    >>> LocalStore("/tmp/horovod")  # doctest: +SKIP
    """


class HDFSStore(Store):
    """Horovod's HDFSStore: ``hdfs://namenode:8020/path``, ``hdfs:///path`` or ``/path``, opened by
    pyarrow's HadoopFileSystem (libhdfs). HDFS is untested here: on paper.

    >>> HDFSStore("hdfs://namenode:8020/user/me/horovod", user="me")  # doctest: +SKIP
    """

    FS_PREFIX = "hdfs://"

    def __init__(self, prefix_path: str, host: Optional[str] = None, port: Optional[int] = None,
                 user: Optional[str] = None, kerb_ticket: Optional[str] = None, driver: str = "libhdfs",
                 extra_conf: Optional[Dict[str, str]] = None, *args: Any, **kwargs: Any):
        if "://" not in prefix_path:
            prefix_path = self.FS_PREFIX + (host or "") + (f":{port}" if port else "") + prefix_path
        options = {k: v for k, v in dict(user=user, kerb_ticket=kerb_ticket, extra_conf=extra_conf).items() if v}
        if options:
            kwargs["storage_options"] = {**options, **(kwargs.get("storage_options") or {})}
        super().__init__(prefix_path, *args, **kwargs)

    @classmethod
    def matches(cls, path: str) -> bool:
        """Whether ``path`` is an HDFS URL."""
        return path.startswith(cls.FS_PREFIX)
