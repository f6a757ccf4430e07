"""Horovod's elastic API inside a rank (``hvd.elastic``): ``TorchState``/``ObjectState`` with
commit, restore, sync and reset callbacks, ``ElasticSampler``, the ``run`` decorator, and the
``StopRequest`` file through which a driver asks its ranks to stop.

Written here, not taken from Horovod: Horovod keeps each worker alive across a change of workers
and forms a new ring in place, which a Spark barrier stage (its tasks start and end together)
cannot. A change of ranks ends the launch; the driver (``run(..., min_proc=...)``) launches again
with the ranks there are. So ``commit()`` also persists the state (rank 0 writes it to
``SPARKRING_ELASTIC_DIR``), and the next launch's decorator loads it, calls the reset callbacks
and syncs every rank from it, as Horovod's does after a reset."""
from __future__ import annotations

import copy
import enum
import functools
import io
import math
import os
import posixpath
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch
from typing_extensions import override

from ..errors import HorovodInternalError, HostsUpdatedInterrupt
from . import basics, environment, mpi_ops
from .functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters


class StopAsk(enum.IntEnum):
    """What the driver asks of the ranks through a StopRequest (an int on the wire and in the
    one-integer broadcast that agrees it on every rank).

    >>> StopAsk(2), max(StopAsk.NOTHING, StopAsk.GROW) == StopAsk.GROW
    (<StopAsk.LEAVE: 2>, True)
    """

    NOTHING = 0
    GROW = 1    # more ranks can train: stop at the next checkpoint or commit, the next launch has them
    LEAVE = 2   # an executor is leaving: checkpoint now and stop, the next launch goes on without it


GROW, LEAVE = StopAsk.GROW, StopAsk.LEAVE


@dataclass(frozen=True)
class Relaunches:
    """What an elastic run did so far: launches after a loss, launches that brought the ranks
    back to the target, launches after an executor was decommissioned (rank 0 logs them).

    >>> Relaunches(restarts=1).restarts
    1
    """

    restarts: int = 0
    grows: int = 0
    decommissions: int = 0

_COMMIT_FILE = "commit.pt"
_REQUEST_FILE = "stop-request"


class StopRequest:
    """The driver's request that the ranks stop: at their next checkpoint or commit (``GROW``:
    more ranks can train; ``LEAVE``: an executor is going away). A small file at ``url`` (a local
    path or any URL fsspec opens) that every rank's store already reaches, so a run whose driver
    cannot be reached (Spark Connect's detached runs) reads it alike.

    >>> import tempfile, os
    >>> request = StopRequest(os.path.join(tempfile.mkdtemp(), "stop-request"))
    >>> request.make(LEAVE); request.read() == LEAVE
    True
    """

    def __init__(self, url: str, storage_options: Optional[Dict[str, Any]] = None):
        self.url = url
        self.storage_options = dict(storage_options or {})

    def _fs(self):
        import fsspec

        return fsspec.core.url_to_fs(self.url, **self.storage_options)

    def make(self, what: StopAsk) -> None:
        """Ask the fit's ranks to stop (``what``: to pause or to leave) by writing the file they poll."""
        fs, path = self._fs()
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
        with fs.open(path, "wb") as f:
            f.write(str(int(what)).encode())

    def read(self) -> StopAsk:
        """What the driver asks (NOTHING where no request is there)."""
        try:
            fs, path = self._fs()
            with fs.open(path, "rb") as f:
                return StopAsk(int(f.read()))
        except (FileNotFoundError, OSError, ValueError):
            return StopAsk.NOTHING

    def clear(self) -> None:
        """Withdraw the request (where there is none, nothing happens)."""
        fs, path = self._fs()
        try:
            fs.rm(path)
        except FileNotFoundError:
            pass


def stop_request_in(directory: str) -> StopRequest:
    """The stop request of an elastic run whose directory (``SPARKRING_ELASTIC_DIR``) is ``directory``.

    >>> stop_request_in("/tmp/elastic").url
    '/tmp/elastic/stop-request'
    """
    return StopRequest(f"{directory.rstrip('/')}/{_REQUEST_FILE}")


@dataclass(frozen=True)
class Paused:
    """What a rank's function returns to the driver when the rank stopped at a commit because
    the driver asked (the launch ends; the next one resumes from that commit).

    >>> Paused(commits=12).commits
    12
    """

    commits: int


class StopAtCommit(BaseException):
    """Ends the user's function (whatever it catches) at a commit the driver asked to stop at;
    the runner's worker turns it into ``Paused``."""

    def __init__(self, commits: int):
        super().__init__(f"stopped at commit {commits} for a new launch")
        self.commits = commits


class _ElasticDir:
    """The run's elastic directory (``SPARKRING_ELASTIC_DIR``): the last commit, rank 0's, and
    the driver's stop request. Absent outside ``run(min_proc=...)``: commits stay in memory."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.request = stop_request_in(self.url)
        self.next_look = 0.0

    @classmethod
    def of_this_rank(cls) -> Optional["_ElasticDir"]:
        url = os.environ.get(environment.ELASTIC_DIR)
        return cls(url) if url else None

    def save(self, snapshot: Dict[str, Any]) -> None:
        import fsspec

        fs, path = fsspec.core.url_to_fs(f"{self.url}/{_COMMIT_FILE}")
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
        buffer = io.BytesIO()
        torch.save(snapshot, buffer)
        tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"  # a reader never sees half a commit
        with fs.open(tmp, "wb") as f:
            f.write(buffer.getvalue())
        fs.mv(tmp, path)

    def load(self) -> Optional[Dict[str, Any]]:
        import fsspec

        fs, path = fsspec.core.url_to_fs(f"{self.url}/{_COMMIT_FILE}")
        try:
            with fs.open(path, "rb") as f:
                return torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=False)
        except FileNotFoundError:
            return None

    def asked(self) -> int:
        """Rank 0 reads the request at most twice a second (a commit may come every step)."""
        if time.monotonic() < self.next_look:
            return 0
        self.next_look = time.monotonic() + 0.5
        return self.request.read()


class State:
    """Horovod's ``hvd.elastic.State``: what ``run`` keeps across launches; ``commit()`` saves it
    (and persists it where the driver asked) and stops the launch when the driver asks.

    >>> state = ObjectState(epoch=0)  # doctest: +SKIP
    >>> state.register_reset_callbacks([lambda: print("world size", sr.size())])  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self._reset_callbacks: List[Callable[[], None]] = []
        self._commits = 0
        self._dir = _ElasticDir.of_this_rank()

    @property
    def commits(self) -> int:
        """Commits so far, over every launch; one you assign (Horovod's ``state.commits += 1``) is yours."""
        return self.__dict__.get("_assigned_commits", self._commits)

    @commits.setter
    def commits(self, value: int) -> None:
        self.__dict__["_assigned_commits"] = value

    def register_reset_callbacks(self, callbacks: List[Callable[[], None]]) -> None:
        """Callbacks run after a reset: here, when a launch resumes from an earlier one's commit."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """The ring was formed anew: reset(), then the callbacks given to register_reset_callbacks()."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state (rank 0 also writes it to the run's elastic directory), then stop the
        launch if the driver asked (``HostsUpdatedInterrupt``, agreed by every rank)."""
        self.save()
        self._commits += 1
        if self._dir is not None and basics.rank() == 0:
            self._dir.save({"snapshot": self._snapshot(), "commits": self._commits, "size": basics.size()})
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` on every rank alike when the driver asked to stop."""
        if self._dir is None:
            return
        seen = self._dir.asked() if basics.rank() == 0 else 0
        agreed = int(mpi_ops.broadcast_(torch.tensor([seen], dtype=torch.int64), root_rank=0,
                                    name="sparkring.elastic.hosts")[0])
        if agreed:
            raise HostsUpdatedInterrupt(skip_sync=agreed == GROW)

    def resume(self) -> bool:
        """At a launch's start: rank 0 loads the last commit of an earlier launch, if any; every
        rank then runs the reset callbacks. Whether there was one."""
        found = self._dir.load() if self._dir is not None and basics.rank() == 0 else None
        resumed = bool(broadcast_object(found is not None, root_rank=0, name="sparkring.elastic.resume")) \
            if self._dir is not None else False
        if found is not None:
            self._commits = int(found["commits"])
            self._load_snapshot(found["snapshot"])
            self.restore()
        if resumed:
            self.on_reset()
        return resumed

    def save(self) -> None:
        """Keep a copy in memory to go back to when a rank fails (commit() calls it)."""
        raise NotImplementedError

    def restore(self) -> None:
        """Go back to the copy save() kept."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make every rank's state rank 0's (after the ring was formed anew)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Objects and variables to reset after a reset event (before the sync)."""

    def _snapshot(self) -> Dict[str, Any]:
        raise NotImplementedError

    def _load_snapshot(self, snapshot: Dict[str, Any]) -> None:
        raise NotImplementedError


class ObjectState(State):
    """Horovod's ``hvd.elastic.ObjectState``: plain Python values, each a keyword argument and an
    attribute, broadcast from rank 0 on sync.

    >>> state = ObjectState(epoch=0, batch=0)
    >>> state.epoch = 3; state.restore(); state.epoch
    0
    """

    def __init__(self, bcast_object: Callable[[Any], Any] = broadcast_object,
                 get_rank: Optional[Callable[[], int]] = None, **kwargs: Any):
        self._bcast_object = bcast_object
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__()

    @override
    def save(self) -> None:
        self._saved_state = {attr: getattr(self, attr) for attr in self._saved_state}

    @override
    def restore(self) -> None:
        self._set_attrs()

    @override
    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)

    def _snapshot(self) -> Dict[str, Any]:
        return {"objects": copy.deepcopy(self._saved_state)}

    def _load_snapshot(self, snapshot: Dict[str, Any]) -> None:
        self._saved_state = snapshot["objects"]


class ElasticSampler(torch.utils.data.Sampler):
    """Horovod's ``hvd.elastic.ElasticSampler``: splits a dataset's (shuffled) indices among the
    ranks there are now, leaving out what this epoch already processed (``record_batch``), so a
    launch with another number of ranks goes on where the commit left off. Call ``set_epoch``
    at the end of each epoch.

    >>> sampler = ElasticSampler(list(range(10)), shuffle=False)  # doctest: +SKIP
    >>> list(sampler)  # rank 0 of 2  # doctest: +SKIP
    [0, 2, 4, 6, 8]
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_num = 0
        self.num_replicas, self.rank = 1, 0
        self.remaining_indices: List[int] = []
        self.num_samples = self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: nothing processed yet, the order drawn again."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one step's samples over every rank as processed."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> Dict[str, int]:
        """The epoch and how many samples of it were processed (what load_state_dict() resumes from)."""
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: Dict[str, int]) -> None:
        """Resume from a state_dict(): the same epoch, past the samples already processed."""
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self) -> None:
        """Split the samples not yet processed over the ranks now in the ring."""
        self.num_replicas, self.rank = basics.size(), basics.rank()
        indices = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(indices)
        self.remaining_indices = indices[self.processed_num:]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        indices = self.remaining_indices[:]
        indices += indices[:self.total_size - len(indices)]  # evenly divisible: repeat the first ones
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


class _Handler:
    """How TorchState saves, restores and syncs one kind of object."""

    def __init__(self, value: Any):
        self.value = value
        self.saved = copy.deepcopy(value.state_dict())

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()

    def sync(self) -> None:
        raise NotImplementedError


class _ModelHandler(_Handler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class _SamplerHandler(_Handler):
    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), root_rank=0))


_HANDLERS = [(torch.nn.Module, _ModelHandler), (torch.optim.Optimizer, _OptimizerHandler),
             (ElasticSampler, _SamplerHandler)]


class TorchState(ObjectState):
    """Horovod's ``hvd.elastic.TorchState``: a model, an optimizer, ElasticSamplers and plain
    values, each an attribute; models and optimizers sync by broadcast from rank 0.

    >>> state = TorchState(model, optimizer, epoch=1, batch=0)  # doctest: +SKIP
    >>> state.commit()  # doctest: +SKIP
    """

    _handlers: Dict[str, _Handler]

    def __init__(self, model: Optional[torch.nn.Module] = None, optimizer: Optional[torch.optim.Optimizer] = None,
                 **kwargs: Any):
        kwargs.update(model=model, optimizer=optimizer)
        handlers: Dict[str, _Handler] = {}
        plain: Dict[str, Any] = {}
        for name, value in kwargs.items():
            kind = next((h for t, h in _HANDLERS if isinstance(value, t)), None)
            if kind is not None:
                handlers[name] = kind(value)
            else:
                plain[name] = value
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(bcast_object=broadcast_object, **plain)

    @override
    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    @override
    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    @override
    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].set_value(value)
        super().__setattr__(name, value)

    def _snapshot(self) -> Dict[str, Any]:
        return {"handlers": {name: h.saved for name, h in self._handlers.items()}, **super()._snapshot()}

    def _load_snapshot(self, snapshot: Dict[str, Any]) -> None:
        for name, saved in snapshot["handlers"].items():
            if name in self._handlers:
                self._handlers[name].saved = saved
        super()._load_snapshot(snapshot)


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Horovod's ``hvd.elastic.run`` decorator: ``func(state, ...)`` starts from the last commit
    of an earlier launch when there is one (reset callbacks called, state synced from rank 0) and
    ends its launch at a commit where the driver asked to stop (more slots, an executor leaving).
    A rank lost under a collective (``HorovodInternalError``) fails the launch: the driver
    launches again and this decorator resumes from the last commit.

    >>> @run
    ... def train(state):
    ...     for state.epoch in range(state.epoch, 10):
    ...         ...
    ...         state.commit()
    """
    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        state.resume()
        state.sync()
        try:
            return func(state, *args, **kwargs)
        except HostsUpdatedInterrupt:
            raise StopAtCommit(state._commits) from None
    return wrapper


__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler", "HostsUpdatedInterrupt",
           "HorovodInternalError", "StopRequest", "StopAsk", "Relaunches", "Paused", "StopAtCommit", "GROW",
           "LEAVE"]
