"""DistributedOptimizer: overlap gradient allreduce with backward through fused buckets.

Written by hand because torch's DDP wraps the model, not the optimizer: Horovod scripts
(and several optimizers over one model) need the optimizer-side hook API.
"""
from __future__ import annotations

import contextlib
import time
import warnings
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch

from . import _checks, _reduce, _runtime, basics
from ._backend import Handle
from ._sparse import allreduce_sparse_grads
from .compression import Compression
from .process_sets import ProcessSet, backend_of
from .timeline import COMM, recorder

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024  # the largest bucket by default (torch DDP's)
FIRST_BUCKET_BYTES = 1024 * 1024
# across hosts a model's gradients travel by default in about this many buckets (1-25 MiB each): one
# bucket as large as DDP's would hold all of a 10 MB model's gradients but the last layer's, leaving
# their whole exchange until backward ends (measured on simulated hosts at 1 Gbit/s: BENCHMARKS.md).
# On one host the exchange runs at memory speed and each bucket is a meeting of every local rank:
# DDP's size there
BUCKETS_PER_MODEL = 8


class _Bucket:
    def __init__(self, params: List[torch.nn.Parameter]):
        self.reset(params)

    def reset(self, params: List[torch.nn.Parameter]) -> None:
        """Hold ``params`` (and nothing in flight): at creation, and when one leaves the bucket."""
        self.params = params
        self.pending = set(id(p) for p in params)
        self.handle: Optional[Handle] = None
        self.buffer: Optional[torch.Tensor] = None
        self.launched_us = 0.0  # when its allreduce started (the timeline's span)
        self._offsets = [0]
        for p in params[:-1]:
            self._offsets.append(self._offsets[-1] + p.numel())

    def offsets(self) -> List[int]:
        """Where each parameter's gradient starts in the flat buffer, in elements."""
        return self._offsets


def _lives_at(grad: torch.Tensor, flat: torch.Tensor, offset: int) -> bool:
    return (grad.is_contiguous() and grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            and grad.storage_offset() == offset)


def _bucket_limit(params: Sequence[torch.Tensor], bucket_bytes: Optional[int], hosts: int) -> int:
    """The largest bucket: ``bucket_bytes`` where given; across ``hosts`` > 1 the gradients' bytes
    over BUCKETS_PER_MODEL, between FIRST_BUCKET_BYTES and DEFAULT_BUCKET_BYTES; else
    DEFAULT_BUCKET_BYTES.

    >>> _bucket_limit([torch.zeros(4 * 2**20)], None, hosts=2) // 2**20  # an eighth of 16 MiB
    2
    """
    if bucket_bytes is not None:
        return bucket_bytes
    if hosts <= 1:
        return DEFAULT_BUCKET_BYTES
    total = sum(p.numel() * p.element_size() for p in params)
    return min(DEFAULT_BUCKET_BYTES, max(FIRST_BUCKET_BYTES, total // BUCKETS_PER_MODEL))


class DistributedOptimizerMixin:
    """Methods grafted onto a subclass of the user's optimizer class."""

    def _sr_setup(self, named_parameters, compression, backward_passes_per_step, op,
                  gradient_predivide_factor, bucket_bytes, sparse_as_dense, process_set):
        params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is not None:
            named = list(named_parameters)
            names = [n for n, _ in named]
            seen = set()
            dups = sorted({n for n in names if n in seen or seen.add(n)})
            if dups:
                raise ValueError(
                    "DistributedOptimizer: named_parameters has duplicate names "
                    f"{dups[:5]}; give every parameter a unique name (with several "
                    "optimizers, prefix each optimizer's names)")
            by_id = {id(p): n for n, p in named}
            missing = [i for i, p in enumerate(params) if id(p) not in by_id]
            if missing:
                raise ValueError(
                    f"DistributedOptimizer: {len(missing)} parameter(s) of the optimizer are not "
                    "in named_parameters; pass model.named_parameters() of the model it optimizes")
        else:  # Horovod's names: allreduce.noname.<group>.<index>
            by_id = {id(p): f"allreduce.noname.{i}.{j}" for i, group in enumerate(self.param_groups)
                     for j, p in enumerate(group["params"])}
        if op not in (_reduce.Average, _reduce.Sum, _reduce.Adasum):
            raise ValueError(f"DistributedOptimizer: op={op!r}; use Average, Sum or Adasum")
        if backward_passes_per_step < 1:
            raise ValueError("DistributedOptimizer: backward_passes_per_step must be >= 1")
        self._sr_names = by_id
        self._parameter_names = {p: by_id[id(p)] for p in params}  # Horovod's attribute: parameter -> name
        # Horovod: a rank outside the optimizer's process set steps on its own gradients
        member = process_set is None or process_set.included() is not False
        self._sr_set = backend_of(process_set) if member else None  # None: the global ring
        if process_set is not None and not process_set._is_global() and op == _reduce.Adasum:
            raise NotImplementedError("Adasum does not support non-global process sets (as in Horovod)")
        self._sr_size, hosts = 1, 1
        if member:
            with _runtime.scope(self._sr_set):
                _checks.agree_shapes([(by_id[id(p)], p) for p in params], "DistributedOptimizer")
                self._sr_size, hosts = basics.size(), basics.cross_size()
        self._sr_compression = compression
        self._sr_bpps = backward_passes_per_step
        self._sr_op = op
        self._sr_predivide = gradient_predivide_factor
        self._sr_should_sync = True
        self._sr_synchronized = False
        self._sr_sparse_as_dense = sparse_as_dense
        self._sr_sparse: Dict[int, torch.Tensor] = {}  # params whose grads came sparse -> this step's grad
        self._sr_densified: Set[int] = set()  # params whose sparse grads travel dense (sparse_as_dense)
        trainable = [p for p in params if p.requires_grad]
        self._sr_params = trainable
        self._sr_param_by_id = {id(p): p for p in trainable}
        self._sr_passes: Dict[int, int] = {id(p): 0 for p in trainable}
        self._sr_buckets = self._sr_make_buckets(trainable, bucket_bytes, hosts)
        self._sr_bucket_of = {id(p): b for b in self._sr_buckets for p in b.params}
        self._sr_next_launch = 0
        self._sr_blocked_s = 0.0
        self._sr_hooks = []
        if self._sr_size > 1:
            for p in trainable:
                self._sr_hooks.append(p.register_post_accumulate_grad_hook(self._sr_hook))

    @staticmethod
    def _sr_make_buckets(params, bucket_bytes, hosts) -> List[_Bucket]:
        # Reverse registration order approximates the order backward produces grads,
        # so the first bucket fills first; a small first bucket starts communication early.
        bucket_bytes = _bucket_limit(params, bucket_bytes, hosts)
        buckets: List[_Bucket] = []
        current: List[torch.nn.Parameter] = []
        current_bytes = 0
        limit = min(FIRST_BUCKET_BYTES, bucket_bytes)
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            if current and (current_bytes + nbytes > limit or p.dtype != current[0].dtype
                            or p.device != current[0].device):
                buckets.append(_Bucket(current))
                current, current_bytes, limit = [], 0, bucket_bytes
            current.append(p)
            current_bytes += nbytes
        if current:
            buckets.append(_Bucket(current))
        return buckets

    def _sr_hook(self, p: torch.Tensor) -> None:
        key = id(p)
        self._sr_passes[key] += 1
        if self._sr_passes[key] < self._sr_bpps:
            return
        bucket = self._sr_bucket_of[key]
        if p.grad is not None and p.grad.is_sparse:
            if self._sr_sparse_as_dense:  # reduced dense, handed back sparse (SparseAdam takes only sparse)
                p.grad = p.grad.to_dense()
                self._sr_densified.add(key)
            else:  # indices + values, as Horovod: the dense bucket never carries this parameter
                self._sr_take_out_of_bucket(p, bucket)
                self._sr_sparse[key] = p.grad  # exchanged together in synchronize()
                return
        bucket.pending.discard(key)
        # Buckets go out in index order on every rank, so collectives always match up.
        while (self._sr_next_launch < len(self._sr_buckets)
               and not self._sr_buckets[self._sr_next_launch].pending):
            self._sr_launch(self._sr_buckets[self._sr_next_launch])
            self._sr_next_launch += 1

    def _sr_take_out_of_bucket(self, p: torch.Tensor, bucket: _Bucket) -> None:
        """A parameter with sparse gradients leaves its bucket for good (every rank decides
        the same: it is the same model)."""
        if any(q is p for q in bucket.params):
            rest = [q for q in bucket.params if q is not p]
            bucket.reset(rest)
            for q in rest:
                if self._sr_passes[id(q)] >= self._sr_bpps:
                    bucket.pending.discard(id(q))

    def _sr_launch(self, bucket: _Bucket) -> None:
        if not bucket.params:
            return
        grads = []
        for p in bucket.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        # one flat buffer per bucket, reused every step: no allocation (and page faults)
        # on the hot path; the reduction happens in place in it
        flat = bucket.buffer
        total = sum(g.numel() for g in grads)
        if flat is None or flat.dtype != grads[0].dtype or flat.device != grads[0].device or flat.numel() != total:
            flat = bucket.buffer = torch.empty(total, dtype=grads[0].dtype, device=grads[0].device)
        # grads that synchronize() left in the buffer and backward accumulated into in place
        # (zero_grad(set_to_none=False)) are already there; only the others are copied
        placed = [_lives_at(g, flat, offset) for g, offset in zip(grads, bucket.offsets())]
        if not any(placed):
            torch.cat([g.reshape(-1) for g in grads], out=flat)
        elif not all(placed):
            for g, offset, there in zip(grads, bucket.offsets(), placed):
                if not there:
                    flat[offset:offset + g.numel()].copy_(g.reshape(-1))
        bucket.launched_us = recorder.now() if recorder.on else 0.0
        if self._sr_op == _reduce.Adasum:
            bucket.handle = _reduce.allreduce_start(flat, flat, _reduce.Adasum)
            return
        prescale = 1.0 / self._sr_predivide if self._sr_predivide != 1.0 else 1.0
        postscale = self._sr_predivide if self._sr_predivide != 1.0 else 1.0
        began = time.perf_counter()  # a transport that reduces as it starts (shared memory) blocks here
        with _runtime.scope(self._sr_set):
            bucket.handle = _reduce.allreduce_start(flat, flat, self._sr_op, self._sr_compression, prescale, postscale)
        self._sr_blocked_s += time.perf_counter() - began

    @property
    def exchange_seconds(self) -> float:
        """Seconds this rank has spent blocked in its gradient exchanges so far: starting them
        (a transport that reduces as it starts, such as the shared-memory ring, blocks there,
        inside backward) and waiting for them in synchronize(). A sparkring addition.

        >>> before = opt.exchange_seconds  # doctest: +SKIP
        >>> loss.backward(); opt.step()  # doctest: +SKIP
        >>> opt.exchange_seconds - before  # this step's  # doctest: +SKIP
        0.0004
        """
        return self._sr_blocked_s

    def synchronize(self) -> None:
        """Finish every gradient allreduce of this step and write the results into .grad.

        >>> opt.synchronize()  # doctest: +SKIP
        >>> torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # doctest: +SKIP
        >>> with opt.skip_synchronize():  # doctest: +SKIP
        ...     opt.step()
        """
        if self._sr_size == 1:
            return
        while self._sr_next_launch < len(self._sr_buckets):
            self._sr_launch(self._sr_buckets[self._sr_next_launch])
            self._sr_next_launch += 1
        if self._sr_sparse:
            keys = sorted(self._sr_sparse, key=lambda k: self._sr_names[k])  # the same order on every rank
            with _runtime.scope(self._sr_set):
                reduced = allreduce_sparse_grads([self._sr_sparse[k] for k in keys], "sparse_gradients",
                                                 self._sr_op)
            for key, grad in zip(keys, reduced):
                self._sr_param_by_id[key].grad = grad
        self._sr_sparse = {}
        for bucket in self._sr_buckets:
            if bucket.handle is None:  # emptied: its parameters' gradients are sparse
                continue
            began = time.perf_counter()
            reduced = bucket.handle.wait()
            self._sr_blocked_s += time.perf_counter() - began
            if recorder.on:
                recorder.add("allreduce", bucket.launched_us, recorder.now(), COMM,
                             bytes=reduced.numel() * reduced.element_size(), tensors=len(bucket.params))
            for p, offset in zip(bucket.params, bucket.offsets()):
                if reduced is bucket.buffer and p.grad.is_contiguous():
                    # like Horovod's p.grad.set_(output): the grad (same tensor object) now
                    # reads the reduced buffer, which saves copying every gradient back
                    p.grad.set_(reduced.untyped_storage(), offset, p.grad.shape, p.grad.stride())
                else:
                    p.grad.copy_(reduced[offset:offset + p.numel()].view_as(p.grad))
            bucket.handle = None
            bucket.pending = set(id(p) for p in bucket.params)
        for key in self._sr_densified:
            param = self._sr_param_by_id[key]
            param.grad = param.grad.to_sparse()
        self._sr_densified = set()
        self._sr_next_launch = 0
        for key in self._sr_passes:
            self._sr_passes[key] = 0
        self._sr_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside this block ``step()`` does not synchronize (call ``synchronize()`` first).

        >>> with opt.skip_synchronize():  # doctest: +SKIP
        ...     opt.step()
        """
        self._sr_should_sync = False
        try:
            yield
        finally:
            self._sr_should_sync = True

    def step(self, closure=None):
        """Wait for the gradients' allreduces, then step the wrapped optimizer (as horovod.torch's does)."""
        if self._sr_should_sync:
            if self._sr_synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to "
                              "consider using optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.", stacklevel=2)
            self.synchronize()
        self._sr_synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True):
        """Zero the gradients; refused while their allreduces are in flight (step() or synchronize() first)."""
        if any(b.handle is not None for b in self._sr_buckets):
            raise RuntimeError(
                "DistributedOptimizer.zero_grad() was called while gradient allreduces are "
                "still in flight; call step() or synchronize() after backward() first")
        # the wrapped optimizer class's own zero_grad (this mixin sits in front of it)
        return super(self.__class__, self).zero_grad(set_to_none)  # type: ignore[misc]


def local_step(optimizer: torch.optim.Optimizer) -> None:
    """One step of the optimizer on this rank's gradients only: a DistributedOptimizer's own
    class's step (its class is a subclass made by DistributedOptimizer), no allreduce."""
    if "_sr_setup" in type(optimizer).__dict__:
        super(type(optimizer), optimizer).step()  # type: ignore[misc]
    else:
        optimizer.step()


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
                         compression=Compression.none, backward_passes_per_step: int = 1,
                         op: str = _reduce.Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups: Optional[Sequence] = None,
                         sparse_as_dense: bool = False,
                         bucket_bytes: Optional[int] = None,
                         process_set: Optional[ProcessSet] = None) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    Allreduces start from gradient hooks while backward is still running, fused into
    buckets of up to ``bucket_bytes``. The result is still an instance of the original
    optimizer class (LR schedulers accept it) and shares its state.

    Arguments:
        optimizer: the torch optimizer to wrap (its parameters are the model's).
        named_parameters: the model's ``named_parameters()``, so that names agree across ranks.
        compression: how gradients travel (``sr.Compression.fp16``, ``.bf16``).
        backward_passes_per_step: local backward passes accumulated before one allreduce.
        op: ``sr.Average`` (default), ``sr.Sum`` or ``sr.Adasum``.
        gradient_predivide_factor: divides gradients before the sum and the rest after it.
        num_groups, groups: Horovod's fusion hints, accepted (the buckets already fuse).
        sparse_as_dense: reduce sparse gradients as dense tensors.
        bucket_bytes: the largest fused allreduce (default: 25 MiB on one host; across hosts an
            eighth of the gradients' bytes, 1 MiB to 25 MiB, so that most of them are exchanged
            while backward runs).
        process_set: average over this ``sr.ProcessSet`` only.

    Returns:
        An instance of ``optimizer``'s class sharing its state, whose ``step()`` applies averaged gradients.

    >>> model = torch.nn.Linear(4, 1)
    >>> opt = sr.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
    ...                               named_parameters=model.named_parameters())
    >>> model(torch.ones(2, 4)).sum().backward(); opt.step()  # doctest: +SKIP
    """
    # num_groups/groups are Horovod's fusion hints; the buckets already fuse, so they are
    # accepted and change nothing.
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               {k: v for k, v in DistributedOptimizerMixin.__dict__.items()
                if k not in ("__dict__", "__weakref__")})
    wrapped: Any = object.__new__(cls)
    # an LR scheduler made before the wrap (Lightning's configure_optimizers does) replaced the
    # optimizer's step with its own counting wrapper; copying that would step the original
    # optimizer and skip the allreduce, so ours counts for that scheduler instead
    counted = optimizer.__dict__.get("step")
    wrapped.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k != "step"})
    wrapped._sr_setup(named_parameters, compression, backward_passes_per_step, op,
                      gradient_predivide_factor, bucket_bytes, sparse_as_dense, process_set)
    if counted is not None and getattr(counted, "_wrapped_by_lr_sched", False):
        distributed_step = wrapped.step

        def step(*args: Any, **kwargs: Any) -> Any:
            optimizer._opt_called = True  # type: ignore[attr-defined]
            return distributed_step(*args, **kwargs)

        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        wrapped.step = step
    return wrapped
