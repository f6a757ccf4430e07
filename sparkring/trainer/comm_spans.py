"""The timeline's spans of model-parallel communication: each DTensor collective (tensor
parallel's all-reduce, all-gather, reduce-scatter) with its bytes, and each pipeline stage's
microbatch forward and backward with the wait for its peer's activations or gradients before it.

Written by hand: torch.profiler traces operators, not spans beside the rest of the run's timeline,
and neither DTensor nor torch's pipeline schedules have a hook for their communication. So while
the timeline records (only then), the functional collectives DTensor calls are wrapped, and waited
at once so that a span is the collective's whole time; and this rank's ``PipelineStage`` objects
(ours, built by the Pipelined placement) get their chunk methods wrapped."""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Dict, Iterator, Tuple

import torch

from sparkring.collective.timeline import COMM, recorder

DTENSOR_COLLECTIVES = ("all_reduce", "all_gather_tensor", "all_gather_single", "reduce_scatter_tensor",
                       "reduce_scatter_single", "all_to_all_single")


@contextlib.contextmanager
def dtensor_collective_spans() -> Iterator[None]:
    """While the timeline records, every DTensor collective of this process is a span on the
    timeline's communication thread ("DTensor all_reduce", with its bytes).

    >>> with dtensor_collective_spans():
    ...     pass
    """
    if not recorder.on:
        yield
        return
    import torch.distributed._functional_collectives as funcol

    originals = {name: getattr(funcol, name) for name in DTENSOR_COLLECTIVES if hasattr(funcol, name)}
    for name, fn in originals.items():
        setattr(funcol, name, _timed_collective(name, fn, funcol.AsyncCollectiveTensor))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(funcol, name, fn)


def _timed_collective(name: str, collective: Callable, async_type: Any) -> Callable:
    @functools.wraps(collective)
    def timed(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        began = recorder.now()
        out = collective(tensor, *args, **kwargs)
        if isinstance(out, async_type):
            out = out.trigger_wait()  # the span is the collective's time, not its launch
        recorder.add(f"DTensor {name}", began, recorder.now(), COMM, bytes=tensor.numel() * tensor.element_size())
        return out
    return timed


def trace_stage(stage: Any) -> None:
    """While the timeline records, this stage's microbatches are spans: "pp forward microbatch 3
    (stage 1)" on the training thread, and before each, the wait for what the peer stage sends
    ("pp receive activations" / "pp receive gradients", with bytes) on the communication thread;
    sends, which torch issues without waiting, are marked where they are issued.

    >>> trace_stage(stage)  # doctest: +SKIP
    """
    if not recorder.on:
        return
    asked: Dict[Tuple[str, int], Tuple[float, int]] = {}
    index = stage.stage_index
    for kind, what in (("fwd", "activations"), ("bwd", "gradients")):
        setattr(stage, f"get_{kind}_recv_ops", _asks(getattr(stage, f"get_{kind}_recv_ops"), kind, asked))
        setattr(stage, f"get_{kind}_send_ops", _sends(getattr(stage, f"get_{kind}_send_ops"), what, index))
    for kind, method, what, verb in (("fwd", "forward_one_chunk", "activations", "forward"),
                                     ("bwd", "backward_one_chunk", "gradients", "backward")):
        setattr(stage, method, _computes(getattr(stage, method), kind, what, verb, index, asked))


def _chunk(args: tuple, kwargs: Dict[str, Any]) -> int:
    return int(args[0] if args else next(iter(kwargs.values())))


def _bytes(ops: Any) -> int:
    return sum(op.tensor.numel() * op.tensor.element_size() for op in ops)


def _asks(get_recv_ops: Callable, kind: str, asked: Dict[Tuple[str, int], Tuple[float, int]]) -> Callable:
    @functools.wraps(get_recv_ops)
    def ask(*args: Any, **kwargs: Any) -> Any:
        ops = get_recv_ops(*args, **kwargs)
        if ops:
            asked[(kind, _chunk(args, kwargs))] = (recorder.now(), _bytes(ops))
        return ops
    return ask


def _sends(get_send_ops: Callable, what: str, index: int) -> Callable:
    @functools.wraps(get_send_ops)
    def send(*args: Any, **kwargs: Any) -> Any:
        ops = get_send_ops(*args, **kwargs)
        if ops:
            now = recorder.now()
            recorder.add(f"pp send {what} (microbatch {_chunk(args, kwargs)})", now, now, COMM, stage=index,
                         bytes=_bytes(ops))
        return ops
    return send


def _computes(compute: Callable, kind: str, what: str, verb: str, index: int,
              asked: Dict[Tuple[str, int], Tuple[float, int]]) -> Callable:
    @functools.wraps(compute)
    def timed(*args: Any, **kwargs: Any) -> Any:
        chunk = _chunk(args, kwargs)
        if (kind, chunk) in asked:
            began, nbytes = asked.pop((kind, chunk))
            recorder.add(f"pp receive {what} (microbatch {chunk})", began, recorder.now(), COMM, stage=index,
                         bytes=nbytes)
        with recorder.span(f"pp {verb} microbatch {chunk} (stage {index})"):
            return compute(*args, **kwargs)
    return timed
