"""join(): ranks that ran out of data keep serving the other ranks' collectives.

Written by hand: torch.distributed's Join context covers only DDP/ZeRO's own hooks, and
Horovod's negotiation lives in its C++ core. Nothing is negotiated while no rank has
joined, so a collective costs a sequence number and a history entry:

- every collective entry point calls ``Joiner.enter(kind, meta)``: its sequence number
  and a recipe (kind, shape, dtype, op...) a joined rank can replay;
- a rank that joins records (its sequence number) in the rendezvous store, tells every
  other rank's watcher thread through that rank's inbox, and then replays, with neutral
  inputs, each collective the active ranks publish under ``op/<seq>``, until the last
  rank joins and publishes "done" under its own sequence number;
- an active rank's watcher (its own store connection, so its blocking wait never stalls
  the main thread) publishes the recipes of the collectives its rank already entered
  from the joiner's sequence number on; from then on each new collective is published
  before it starts. Either the watcher or the main thread publishes, under one lock,
  so none is missed even when the main thread is already blocked in that collective.

Rounds: every rank calls join() once per round (typically once per epoch); keys carry
the round number so a round's leftovers never confuse the next.
"""
from __future__ import annotations

import collections
import dataclasses
import datetime
import json
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

PREFIX = "sparkring/join/"
_FOREVER = datetime.timedelta(days=30)
_HISTORY_LIMIT = 100_000


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How to take part in one collective without data: what a joined rank replays.

    >>> Recipe("allreduce", shape=(3,), dtype="torch.float32", op="Sum", path="blocking").to_json()  # doctest: +SKIP
    """

    kind: str
    shape: Tuple[int, ...] = ()
    tail: Tuple[int, ...] = ()      # allgather/alltoall: every dimension but the first
    dtype: str = ""
    op: str = ""
    path: str = ""                  # allreduce: "new" | "blocking" | "async" | "adasum"
    compression: str = ""           # allreduce: "module:qualname" of the Compression
    prescale: float = 1.0
    postscale: float = 1.0
    root: int = -1                  # broadcast / broadcast_object
    name: str = ""                  # the caller's name (ranks agree on it)
    checked: bool = False           # allreduce: the ranks agreed on its arguments first

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "Recipe":
        fields = {f.name for f in dataclasses.fields(cls)}
        values: Dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v) for k, v in data.items()
                                  if k in fields}
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class Joined:
    """In ``joined/<order>``: ``rank`` joined this round at its collective number ``seq``."""

    rank: int
    seq: int


@dataclasses.dataclass(frozen=True)
class Notice:
    """In a rank's inbox: some rank joined round ``round`` at ``seq`` (or ``stop``: the ring is
    closing, the watcher ends)."""

    round: int = -1
    seq: int = -1
    stop: bool = False


@dataclasses.dataclass(frozen=True)
class AllJoined:
    """Under ``op/<seq>`` instead of a Recipe: every rank joined, the last was ``last``.

    >>> _decode_op(AllJoined(last=1).to_json())
    AllJoined(last=1)
    """

    last: int

    def to_json(self) -> str:
        return json.dumps({"all_joined": self.last})


def _to_json(message: Any) -> str:
    return json.dumps(dataclasses.asdict(message))


def _decode_op(text: str) -> "Recipe | AllJoined":
    data = json.loads(text)
    return AllJoined(int(data["all_joined"])) if "all_joined" in data else Recipe.from_dict(data)


class Joiner:
    """Per-process join state; ``replay(recipe)`` runs one collective with neutral inputs."""

    def __init__(self, rank: int, size: int, store, watch_store, replay: Callable[[Recipe], None]):
        self.rank = rank
        self.size = size
        self._store = store
        self._watch_store = watch_store
        self._replay = replay
        self._lock = threading.Lock()
        self._seq = 0
        self._round = 0
        self._joined = False
        self._history: Deque[Tuple[int, Recipe]] = collections.deque()
        self._publish_from: Optional[int] = None  # first seq the current round's joiners need
        self._early: Dict[int, List[int]] = {}  # join seqs the watcher saw for later rounds
        self._stopping = False  # the watcher got its stop message (rank 0 may be gone soon)
        self._thread = threading.Thread(target=self._watch, name="sparkring-join-watcher", daemon=True)
        self._thread.start()

    # -- every collective ---------------------------------------------------------------

    def enter(self, recipe: Recipe) -> int:
        with self._lock:
            seq = self._seq
            self._seq += 1
            if self._publish_from is not None and not self._joined:
                self._publish(seq, recipe)
            else:
                self._history.append((seq, recipe))
                if len(self._history) > _HISTORY_LIMIT:
                    self._history.popleft()
            return seq

    def completed(self, seq: int) -> None:
        """Every rank has entered collective ``seq`` (it needed them all): a later joiner
        starts after it, so the history up to it can go."""
        with self._lock:
            while self._history and self._history[0][0] <= seq:
                self._history.popleft()

    def _publish(self, seq: int, recipe: Recipe) -> None:
        self._store.set(f"{PREFIX}{self._round}/op/{seq}", recipe.to_json())

    def _someone_joined_at(self, seq: int) -> None:
        """Called with the lock held: publish what a rank that joined at ``seq`` needs."""
        if self._joined or (self._publish_from is not None and self._publish_from <= seq):
            return
        upto = self._publish_from
        for s, recipe in self._history:
            if s >= seq and (upto is None or s < upto):
                self._publish(s, recipe)
        self._publish_from = seq

    # -- join ---------------------------------------------------------------------------

    def join(self) -> int:
        with self._lock:
            my_seq, rnd = self._seq, self._round
        base = f"{PREFIX}{rnd}/"
        order = self._store.add(base + "count", 1)
        self._store.set(f"{base}joined/{order}", _to_json(Joined(rank=self.rank, seq=my_seq)))
        earlier = [Joined(**json.loads(self._store.get(f"{base}joined/{i}"))) for i in range(1, order)]
        with self._lock:
            if earlier:  # our watcher may not have told us yet
                self._someone_joined_at(min(e.seq for e in earlier))
            self._joined = True
        for other in range(self.size):
            if other != self.rank:
                self._notify(other, Notice(round=rnd, seq=my_seq))
        try:
            if order == self.size:
                self._store.set(f"{base}op/{my_seq}", AllJoined(last=self.rank).to_json())
                last = self.rank
            else:
                last = self._serve(base)
        finally:
            with self._lock:
                self._joined = False
                self._round = rnd + 1
                self._history.clear()
                early = self._early.pop(rnd + 1, [])
                self._publish_from = min(early) if early else None
        return last

    def _serve(self, base: str) -> int:
        """Replay the active ranks' collectives until the last rank joins."""
        while True:
            with self._lock:
                key = f"{base}op/{self._seq}"
            # no deadline here: the runner's timeout decides when a ring hangs
            self._store.wait([key], _FOREVER)
            message = _decode_op(self._store.get(key))
            if isinstance(message, AllJoined):
                return message.last
            self._replay(message)

    # -- the watcher ----------------------------------------------------------------------

    def _notify(self, rank: int, message: Notice) -> None:
        n = self._store.add(f"{PREFIX}inbox/{rank}/n", 1)
        self._store.set(f"{PREFIX}inbox/{rank}/{n}", _to_json(message))

    def _watch(self) -> None:
        n = 1
        while True:
            key = f"{PREFIX}inbox/{self.rank}/{n}"
            try:
                self._watch_store.wait([key], _FOREVER)
                message = Notice(**json.loads(self._watch_store.get(key)))
            except Exception:  # noqa: BLE001 - the store is gone: the ring is over
                return
            n += 1
            if message.stop:
                with self._lock:
                    self._stopping = True
                try:
                    self._watch_store.set(f"{PREFIX}stopped/{self.rank}", "1")
                except Exception:  # noqa: BLE001
                    pass
                return
            with self._lock:
                if message.round == self._round:
                    self._someone_joined_at(message.seq)
                elif message.round > self._round:
                    self._early.setdefault(message.round, []).append(message.seq)

    def close(self) -> None:
        """Stop the watchers before the store goes away (rank 0 hosts it): a watcher whose
        store vanishes under it makes torch print a C++ stack trace."""
        try:
            with self._lock:
                if not self._stopping:  # rank 0 did not stop our watcher yet: the store is up
                    self._notify(self.rank, Notice(stop=True))
            if self.rank == 0:
                for other in range(1, self.size):
                    self._notify(other, Notice(stop=True))
                keys = [f"{PREFIX}stopped/{r}" for r in range(self.size)]
                deadline = time.monotonic() + 2.0
                while time.monotonic() < deadline and not self._store.check(keys):
                    time.sleep(0.005)
        except Exception:  # noqa: BLE001 - shutting down after a failure: nothing to save
            pass
        self._thread.join(timeout=2.0)
