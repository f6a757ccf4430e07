"""One naming scheme for a fit's checkpoints, replicated files and sharded directories alike, and
which of them is the newest complete one (what a fit launched now resumes from)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from ..errors import StoreError
from .state import TrainerState

FILE, SHARDED = ".pt", ".dcp"  # a replicated model's one file; a directory of every rank's shards
TRAINER_STATE = "trainer.pt"  # inside a sharded checkpoint, written last by rank 0: the checkpoint is complete
_NAME = re.compile(r"^epoch-(\d{5})(?:-step-(\d{7}))?(\.pt|\.dcp)$")
KEEP = 2  # the latest, and the one before in case the latest is cut short


@dataclass(frozen=True)
class CheckpointName:
    """Where a checkpoint stands: after ``epoch`` (0-based), or inside it before ``step`` (the
    0-based step to go on at; elastic fits). ``position`` orders them.

    >>> CheckpointName(epoch=1, step=137, kind=FILE).name
    'epoch-00001-step-0000137.pt'
    >>> CheckpointName.parse("epoch-00002.dcp")
    CheckpointName(epoch=2, step=None, kind='.dcp')
    >>> CheckpointName.parse("stop-request") is None
    True
    """

    epoch: int
    step: Optional[int]
    kind: str

    @property
    def position(self) -> Tuple[int, float]:
        """Sorts checkpoints in training order: inside an epoch before its end."""
        return self.epoch, float("inf") if self.step is None else float(self.step)

    @property
    def name(self) -> str:
        """The directory's name: epoch-NNNNN, -step-NNNNNNN within an epoch, and the kind's suffix."""
        return f"epoch-{self.epoch:05d}" + (f"-step-{self.step:07d}" if self.step is not None else "") + self.kind

    @classmethod
    def parse(cls, name: str) -> Optional["CheckpointName"]:
        """The checkpoint a directory name stands for; None for other names."""
        found = _NAME.match(name)
        if found is None:
            return None
        return cls(int(found.group(1)), int(found.group(2)) if found.group(2) else None, found.group(3))

    def where(self) -> str:
        """The position a fit resumed from here goes on at, in the console's words (from 1)."""
        if self.step is not None:
            return f"step {self.step + 1} of epoch {self.epoch + 1}"
        return f"the start of epoch {self.epoch + 2}"


def listing(store, run_id: str, kind: str) -> List[CheckpointName]:
    """The run's checkpoints of one kind, oldest first (complete or not)."""
    found = (CheckpointName.parse(n) for n in store.listdir(store.checkpoint_path(run_id)))
    return sorted((c for c in found if c is not None and c.kind == kind), key=lambda c: c.position)


def is_complete(store, run_id: str, checkpoint: CheckpointName) -> bool:
    """A file is complete once written (written whole); a sharded directory once its trainer state is."""
    return checkpoint.kind == FILE or store.exists(store.checkpoint_path(run_id, checkpoint.name, TRAINER_STATE))


def latest(store, run_id: str) -> Optional[CheckpointName]:
    """The newest complete checkpoint of the run, of either kind.

    >>> latest(store, "r1")  # doctest: +SKIP
    CheckpointName(epoch=1, step=137, kind='.pt')
    """
    both = listing(store, run_id, FILE) + listing(store, run_id, SHARDED)
    for checkpoint in sorted(both, key=lambda c: c.position, reverse=True):
        if is_complete(store, run_id, checkpoint):
            return checkpoint
    return None


def resume_point(store, run_id: str) -> str:
    """Where a fit launched now resumes, in the console's words.

    >>> resume_point(store, "r1")  # epoch-00001-step-0000137.pt  # doctest: +SKIP
    'step 138 of epoch 2'
    """
    newest = latest(store, run_id)
    return "the start" if newest is None else newest.where()


def prune(store, run_id: str, kind: str) -> None:
    """Delete all but the KEEP newest checkpoints of one kind."""
    for old in listing(store, run_id, kind)[:-KEEP]:
        store.delete(store.checkpoint_path(run_id, old.name))


def on_cpu(obj):
    """``obj`` with every tensor in its dicts, lists and tuples copied to the CPU (a checkpoint a
    host without the GPU, or with fewer, can load).

    >>> on_cpu({"w": [torch.ones(1)]})
    {'w': [tensor([1.])]}
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return type(obj)((k, on_cpu(v)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(on_cpu(v) for v in obj)
    return obj


def trainable_state(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The model's state a checkpoint keeps: every buffer and every parameter that trains. Frozen
    parameters (a LoRA fit's base weights) are rebuilt as they were by the model's factory, so a
    checkpoint holds the adapters only.

    >>> m = torch.nn.Linear(2, 1); m.bias.requires_grad_(False)  # doctest: +ELLIPSIS
    Parameter containing:...
    >>> sorted(trainable_state(m))
    ['weight']
    """
    return {name: value.detach() for name, value in model.state_dict(keep_vars=True).items()
            if not (isinstance(value, torch.nn.Parameter) and not value.requires_grad)}


def load_trainable(model: torch.nn.Module, state: Dict[str, torch.Tensor]) -> None:
    """Load a checkpoint's ``trainable_state``: what it lacks must be the model's frozen parameters."""
    frozen = set(model.state_dict()) - set(trainable_state(model))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - frozen:
        raise RuntimeError(f"the checkpoint does not fit the model: missing {sorted(set(missing) - frozen)}, "
                           f"unexpected {sorted(unexpected)} (the model changed since it was written?)")


def frozen_free():
    """torch.distributed.checkpoint's options that leave frozen parameters out of a sharded
    checkpoint and load one without them, as ``trainable_state`` does for a file."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, strict=False)


def _storage_cause(exc: BaseException) -> Optional[BaseException]:
    """The filesystem's own error behind ``exc`` (an OSError, or botocore's and the like, also
    inside DCP's CheckpointException of every rank's failures), or None where it is no storage fault."""
    seen: set = set()
    todo: List[Optional[BaseException]] = [exc]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) or type(current).__module__.split(".")[0] in _STORAGE_MODULES:
            return current
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            todo += [pair[0] if isinstance(pair, tuple) else pair for pair in failures.values()]
        todo += [current.__cause__, current.__context__]
    return None


_STORAGE_MODULES = ("botocore", "aiobotocore", "s3fs", "gcsfs", "adlfs", "azure", "google", "fsspec", "aiohttp")


def unwritten(store, run_id: str, state: TrainerState, exc: BaseException) -> Optional[StoreError]:
    """The error a fit fails with when its checkpoint could not be written to the Store (after the
    filesystem's and the Store's own bounded retries): naming the Store, the checkpoint and the
    step; None where ``exc`` is no storage fault. The checkpoints written before stay.

    >>> from sparkring.data import Store
    >>> from sparkring.trainer.state import TrainerState
    >>> state = TrainerState(epoch=1, history=[], seed=0, stopped=False)
    >>> unwritten(Store("/tmp/s"), "r", state, ConnectionRefusedError(111, "refused"))  # doctest: +NORMALIZE_WHITESPACE
    StoreError("the checkpoint to go on at the start of epoch 3 could not be written to the Store /tmp/s ([Errno 111]
    refused); the checkpoints before it are kept: fit again with runId='r' once the Store is back, to go on from the
    last complete one")
    """
    cause = _storage_cause(exc)
    if cause is None:
        return None
    if isinstance(cause, StoreError) and cause.__cause__ is not None:  # the Store's retries gave up: why
        cause = cause.__cause__
    where = CheckpointName(state.epoch, state.step, FILE).where()
    return StoreError(f"the checkpoint to go on at {where} could not be written to the Store {store.url} ({cause}); "
                      f"the checkpoints before it are kept: fit again with runId={run_id!r} once the Store is back, "
                      "to go on from the last complete one")
