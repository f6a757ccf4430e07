"""How the model lives on the ranks: one Placement per way (replicated, sharded, tensor parallel, pipelined).

Each is built from a PlacementConfig and owns the build, the optimizer's wrapping, the update, the
finite check, the checkpoints and the gather of the fitted state, so that the loop never asks which
one it has.

torchtitan's components/checkpoint and Horovod's estimator/remote split are the models: the loop
says when (an epoch ends, a step is due), the placement says how."""
from __future__ import annotations

import functools
import io
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Union

import torch
from typing_extensions import override

import sparkring.collective as sr

from . import checkpoints, comm_spans, fsdp, gradients, pipeline, pretrained, saving, tensor_parallel
from .activation import checkpoint_activations
from .batches import run_batches
from .checkpoints import FILE, SHARDED, CheckpointName, on_cpu
from .config import Compression, ModelOrFactory, ModelParallel, Sharding, TrainConfig, is_factory
from .pretrained import StoredModel
from .state import TrainerState
from .step import PlainStep, Step

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlacementConfig:
    """What a placement is built from (``build()`` picks the placement the degrees and the strategy
    name): where checkpoints go, the sharding and model-parallel degrees, the replicated gradient
    exchange's compression and accumulation, the clip norm, and (for a pipeline, whose model torch's
    tracer cuts) a function giving one microbatch of forward()'s arguments.

    >>> type(PlacementConfig(store=None, run_id="r").build()).__name__
    'Replicated'
    """

    store: Any
    run_id: str
    sharding: Sharding = field(default_factory=Sharding)
    parallel: ModelParallel = field(default_factory=ModelParallel)
    compression: Compression = "none"
    backward_passes_per_step: int = 1
    clip_norm: Optional[float] = None   # gradientClipNorm
    example: Optional[Callable[[torch.device], tuple]] = None
    dcp_checkpoints: bool = False       # a replicated model's checkpoints as DCP too (a pretrained fit's)

    @classmethod
    def of(cls, cfg: TrainConfig, dcp_checkpoints: bool = False) -> "PlacementConfig":
        """The placement a fit's TrainConfig asks for (``dcp_checkpoints``: a pretrained model's fit)."""
        return cls(store=cfg.store, run_id=cfg.run_id, sharding=cfg.sharding, parallel=cfg.parallel,
                   compression=cfg.compression, backward_passes_per_step=cfg.backward_passes_per_step,
                   clip_norm=cfg.gradient_clip_norm, dcp_checkpoints=dcp_checkpoints,
                   example=functools.partial(_pipeline_example, cfg) if cfg.parallel.pipeline_parallel > 1 else None)

    def build(self) -> "Placement":
        """The placement: a pipeline's where there are stages, tensor-parallel where layers are split,
        else sharded or replicated as the strategy says."""
        if self.parallel.pipeline_parallel > 1:
            return Pipelined(self)
        if self.parallel.enabled:
            return TensorParallel(self)
        if self.sharding.sharded:
            return Sharded(self)
        return Replicated(self)


def _typed(saved: Optional[Dict[str, Any]]) -> Optional[TrainerState]:
    """The loop's state a checkpoint held (a dict on storage), typed; None for a fresh start."""
    return TrainerState.from_dict(saved) if saved is not None else None


class Placement:
    """The seam between the loop and the way the model is placed. Every method is called on
    every rank, in the same order (each may run collectives).

    >>> placement_for(cfg).build(cfg.model, torch.device("cpu"), seed=0)  # doctest: +SKIP
    """

    def __init__(self, config: PlacementConfig):
        self.config = config
        self.store, self.run_id, self.sharding = config.store, config.run_id, config.sharding

    def build(self, model: Union[ModelOrFactory, StoredModel], device: torch.device, seed: int) -> torch.nn.Module:
        """This rank's model (or its part of it), on ``device``."""
        raise NotImplementedError

    def distribute(self, opt: torch.optim.Optimizer, model: torch.nn.Module) -> Any:
        """The optimizer the loop steps: ``opt`` wrapped for this placement's gradient exchange."""
        raise NotImplementedError

    def resume(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> Optional[TrainerState]:
        """Load the newest complete checkpoint into ``model`` and ``opt`` and make every rank's
        alike; the loop's state it holds (the same on every rank), or None for a fresh start."""
        raise NotImplementedError

    def update(self, opt: Any, model: torch.nn.Module, *, skip_non_finite: bool,
               scaler: Optional[torch.amp.GradScaler]) -> int:
        """The optimizer step after the gradients are in; 1 where a non-finite update was skipped."""
        raise NotImplementedError

    def blocked_seconds(self, opt: Any) -> float:
        """Seconds blocked in gradient exchanges so far (counted apart from compute)."""
        return 0.0

    def clip_gradients(self, model: torch.nn.Module) -> None:
        """Clip the gradients' global norm to gradientClipNorm, where set (every rank alike)."""
        if self.config.clip_norm is not None:
            gradients.clip_norm(model, self.config.clip_norm, self.norm_group())

    def norm_group(self) -> Any:
        """The process group whose ranks hold other parameters than this rank's DTensors say (a pipeline's)."""
        return None

    def compiled(self, model: torch.nn.Module, options: Optional[Dict[str, Any]]) -> Any:
        """What runs the steps: ``model`` through torch.compile with ``options`` (None: eager); the
        module itself keeps the weights that are saved."""
        return torch.compile(model, **options) if options is not None else model

    def save(self, model: torch.nn.Module, opt: Any, state: TrainerState) -> None:
        """A checkpoint at the position ``state`` holds (its "epoch" and "step")."""
        raise NotImplementedError

    def gather(self, model: torch.nn.Module) -> Optional[Dict[str, torch.Tensor]]:
        """The whole model's state on rank 0's CPU (None on the other ranks)."""
        raise NotImplementedError

    def write_fitted(self, model: torch.nn.Module, store: Any, directory: str) -> None:
        """Write the fitted weights as safetensors into ``directory`` of ``store`` (every rank calls
        it): here rank 0 writes the state ``gather`` put together."""
        state = self.gather(model)
        if state is not None:
            saving.clear(store, directory)
            saving.write_safetensors(store, directory, state)

    def finish(self) -> None:
        """Complete what is still being written (the fit ends or pauses here)."""

    def step(self, cfg: TrainConfig, device: torch.device, rank: int) -> Step:
        """The step the loop runs each batch through (built after ``build``)."""
        return PlainStep(cfg, device, rank)

    def data_rank(self) -> int:
        """Which share of the rows this rank reads (ranks holding slices of one model read the same)."""
        return sr.rank()

    def data_size(self) -> int:
        """How many shares the rows are split into."""
        return sr.size()


def whole_model(model: Union[ModelOrFactory, StoredModel], device: torch.device, seed: int,
                init_fn: Optional[Callable[[torch.nn.Module], None]] = None) -> torch.nn.Module:
    """The whole model on ``device``: a factory's built from ``seed`` (the same on every rank), a
    stored model's read from storage (what the storage lacks initialized from ``seed``).

    >>> whole_model(lambda: torch.nn.Linear(2, 1), torch.device("cpu"), seed=0).weight.shape
    torch.Size([1, 2])
    """
    if isinstance(model, StoredModel):
        return pretrained.materialized(model, device, seed, init_fn)
    if is_factory(model):
        torch.manual_seed(seed)
        return model().to(device)  # type: ignore[operator]
    assert isinstance(model, torch.nn.Module)
    return model.to(device)


def _sharded(model: Union[ModelOrFactory, StoredModel], sharding: Sharding, device: torch.device, seed: int,
             **kwargs: Any) -> torch.nn.Module:
    stored = model if isinstance(model, StoredModel) else None
    return fsdp.build_sharded(stored.module if stored is not None else model, sharding, device, seed,
                              stored=stored, **kwargs)


def scaled_update(opt: Any, scaler: torch.amp.GradScaler, clip: Callable[[], None] = lambda: None) -> int:
    """16-mixed: unscale the reduced gradients, clip them where asked, step unless they overflowed;
    the reduced gradients are the same on every rank, so is the decision. 1 where the step was skipped.

    >>> scaled_update(distributed_optimizer, torch.amp.GradScaler("cpu"))  # doctest: +SKIP
    0
    """
    opt.synchronize()
    scaler.unscale_(opt)
    clip()
    before = scaler.get_scale()
    with opt.skip_synchronize():
        scaler.step(opt)
    scaler.update()
    return int(scaler.get_scale() < before)


class Replicated(Placement):
    """Every rank holds the whole model; DistributedOptimizer allreduces the gradients in
    buckets; rank 0 writes a checkpoint as one file (a pretrained fit's: DCP, which any
    placement and numProc resumes from) and keeps the fitted state."""

    def __init__(self, config: PlacementConfig):
        super().__init__(config)
        self.checkpointer: Optional[fsdp.Checkpointer] = None

    @override
    def build(self, model: Union[ModelOrFactory, StoredModel], device: torch.device, seed: int) -> torch.nn.Module:
        module = whole_model(model, device, seed, self.sharding.init_fn)
        checkpoint_activations(module, self.sharding.activation_checkpointing, self.sharding.wrap)
        if self.config.dcp_checkpoints:
            self.checkpointer = fsdp.Checkpointer(self.store, self.run_id)
        return module

    @override
    def distribute(self, opt: torch.optim.Optimizer, model: torch.nn.Module) -> Any:
        return sr.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=getattr(sr.Compression, self.config.compression),
                                       backward_passes_per_step=self.config.backward_passes_per_step)

    def resume(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> Optional[TrainerState]:
        """Rank 0 reads the last checkpoint; every rank then starts from rank 0's state. A sharded
        or tensor-parallel fit's checkpoint (DCP) is read whole by every rank."""
        newest = checkpoints.latest(self.store, self.run_id) if sr.rank() == 0 else None
        if sr.broadcast_object(newest is not None and newest.kind == SHARDED, root_rank=0):
            return _typed(fsdp.load_latest(self.store, self.run_id, model, opt))
        state = None
        if sr.rank() == 0:
            saved = self._load_latest()
            if saved is not None:
                checkpoints.load_trainable(model, saved.pop("model"))
                opt.load_state_dict(saved.pop("optimizer"))
                state = saved
        state = sr.broadcast_object(state, root_rank=0)
        sr.broadcast_parameters(model.state_dict(), root_rank=0)
        if state is not None:  # fresh optimizers are alike: making state to broadcast would count an extra Adam step
            sr.broadcast_optimizer_state(opt, root_rank=0)
        return _typed(state)

    def _load_latest(self) -> Optional[Dict[str, Any]]:
        for found in reversed(checkpoints.listing(self.store, self.run_id, FILE)):
            try:
                data = self.store.read_bytes(self.store.checkpoint_path(self.run_id, found.name))
                # tensors, numbers and strings only: no pickled code runs when a checkpoint loads
                return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001 - a damaged file: fall back to the one before
                log.warning("checkpoint %s of run %s cannot be loaded (%s); trying the one before",
                            found.name, self.run_id, exc)
        return None

    @override
    def update(self, opt: Any, model: torch.nn.Module, *, skip_non_finite: bool,
               scaler: Optional[torch.amp.GradScaler]) -> int:
        if scaler is not None:
            return scaled_update(opt, scaler, lambda: self.clip_gradients(model))
        opt.synchronize()
        # the reduced gradients are the same on every rank: so is the decision to skip
        if skip_non_finite and not gradients.finite_here(model):
            return 1
        self.clip_gradients(model)
        with opt.skip_synchronize():
            opt.step()
        return 0

    @override
    def blocked_seconds(self, opt: Any) -> float:
        return opt.exchange_seconds

    def save(self, model: torch.nn.Module, opt: Any, state: TrainerState) -> None:
        """Rank 0's file: the weights, the optimizer's state and the loop's, on the CPU (or DCP)."""
        if self.checkpointer is not None:
            self.checkpointer.save(state.epoch, model, opt, state.to_dict(), step=state.step)
            return
        if sr.rank() != 0:
            return
        buf = io.BytesIO()
        torch.save(on_cpu({"model": checkpoints.trainable_state(model), "optimizer": opt.state_dict(),
                           **state.to_dict()}), buf)
        name = CheckpointName(state.epoch, state.step, FILE).name
        self.store.write_bytes(self.store.checkpoint_path(self.run_id, name), buf.getvalue())
        checkpoints.prune(self.store, self.run_id, FILE)

    @override
    def finish(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.finish()

    @override
    def gather(self, model: torch.nn.Module) -> Optional[Dict[str, torch.Tensor]]:
        if sr.rank() != 0:
            return None
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}


class Sharded(Placement):
    """FSDP2 (``fsdp``: over every rank; ``hsdp``: within each host, replicated across hosts):
    each rank keeps its shards, writes them into a DCP checkpoint directory, and at the end writes
    its files of the fitted weights, each tensor put together on the rank that writes it
    (trainer.fsdp has the mechanics)."""

    def __init__(self, config: PlacementConfig):
        super().__init__(config)
        self.checkpointer: Optional[fsdp.Checkpointer] = None

    @override
    def build(self, model: Union[ModelOrFactory, StoredModel], device: torch.device, seed: int) -> torch.nn.Module:
        module = _sharded(model, self.sharding, device, seed)
        # an asynchronous checkpointer makes a process group of its own: every rank, after the mesh's
        self.checkpointer = fsdp.Checkpointer(self.store, self.run_id, self.sharding.async_checkpoint)
        return module

    @override
    def distribute(self, opt: torch.optim.Optimizer, model: torch.nn.Module) -> Any:
        return opt  # FSDP2 reduce-scatters the gradients itself

    @override
    def resume(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> Optional[TrainerState]:
        return _typed(fsdp.load_latest(self.store, self.run_id, model, opt))

    @override
    def update(self, opt: Any, model: torch.nn.Module, *, skip_non_finite: bool,
               scaler: Optional[torch.amp.GradScaler]) -> int:
        if skip_non_finite and not gradients.finite_everywhere(model):
            return 1
        self.clip_gradients(model)
        opt.step()
        return 0

    @override
    def save(self, model: torch.nn.Module, opt: Any, state: TrainerState) -> None:
        assert self.checkpointer is not None, "build() first"
        self.checkpointer.save(state.epoch, model, opt, state.to_dict(), step=state.step)

    @override
    def gather(self, model: torch.nn.Module) -> Optional[Dict[str, torch.Tensor]]:
        self.finish()
        state = fsdp.full_state_dict(model)
        return state if sr.rank() == 0 else None

    @override
    def write_fitted(self, model: torch.nn.Module, store: Any, directory: str) -> None:
        self.finish()
        fsdp.write_state(model, store, directory)  # each rank its files: rank 0 never holds the whole model

    @override
    def finish(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.finish()


class TensorParallel(Sharded):
    """Tensor parallelism on a (dp, tp) mesh: each tp group (consecutive ranks of a host) holds
    slices of the planned layers (torch's parallelize_module) and reads the same rows; over dp the
    model is replicated (``ddp``: gradients averaged over dp here) or sharded (``fsdp``: FSDP2 on
    the dp submesh). Checkpoints are DCP directories (they reshard on load, to any layout); at
    the end every rank writes its files of the fitted weights, as Sharded does."""

    def __init__(self, config: PlacementConfig):
        super().__init__(config)
        self.parallel = config.parallel
        self.mesh: Any = None

    @override
    def build(self, model: Union[ModelOrFactory, StoredModel], device: torch.device, seed: int) -> torch.nn.Module:
        self.mesh = sr.device_mesh(tp=self.parallel.tensor_parallel)
        tp_mesh = self.mesh["tp"]

        def split(module: torch.nn.Module) -> torch.nn.Module:
            return tensor_parallel.parallelize(module, self.parallel.plan, tp_mesh)

        if self.sharding.sharded:
            module = _sharded(model, self.sharding, device, seed, mesh=self.mesh["dp"], split=split)
        elif isinstance(model, StoredModel) and model.empty:
            split(model.module)  # on the meta device: each rank then reads only its slices
            module = pretrained.materialized(model, device, seed, self.sharding.init_fn)
            checkpoint_activations(module, self.sharding.activation_checkpointing, self.sharding.wrap)
        else:
            module = split(whole_model(model, device, seed, self.sharding.init_fn))
            checkpoint_activations(module, self.sharding.activation_checkpointing, self.sharding.wrap)
        self.checkpointer = fsdp.Checkpointer(self.store, self.run_id, self.sharding.async_checkpoint)
        return module

    @override
    def update(self, opt: Any, model: torch.nn.Module, *, skip_non_finite: bool,
               scaler: Optional[torch.amp.GradScaler]) -> int:
        if not self.sharding.sharded:
            gradients.average_over(model, self.mesh["dp"])
        return super().update(opt, model, skip_non_finite=skip_non_finite, scaler=scaler)

    @override
    def data_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    @override
    def data_size(self) -> int:
        return self.mesh["dp"].size()


class Pipelined(TensorParallel):
    """Pipeline parallelism on the (pp, dp, tp) mesh: each rank of a pipeline holds its stage(s)
    (trainer.pipeline cuts the model and runs the schedule), split further over tp where asked; over
    dp replicated or sharded as TensorParallel; the stages' figures reach every rank of the pipeline.
    The whole model is built once on every rank (from the seed) before each keeps its stages."""

    def __init__(self, config: PlacementConfig):
        super().__init__(config)
        self.stages: List[Any] = []
        self.indices: List[int] = []

    @override
    def build(self, model: Union[ModelOrFactory, StoredModel], device: torch.device, seed: int) -> torch.nn.Module:
        from torch.distributed.pipelining import PipelineStage

        p = self.parallel
        self.mesh = sr.device_mesh(tp=p.tensor_parallel, pp=p.pipeline_parallel)
        # a stored model cut into stages of its own modules gets values for this rank's stages only
        stored = model if isinstance(model, StoredModel) and model.empty and pipeline.keeps_modules(model.module) \
            else None
        whole = stored.module if stored is not None else whole_model(model, device, seed, self.sharding.init_fn)
        split = list(p.pipeline_split) or pipeline.balanced_split(whole, p.stages, self.sharding.wrap)
        assert self.config.example is not None, "a pipeline needs PlacementConfig.example"
        example = self.config.example
        parts = pipeline.cut(whole, split, lambda: example(device))
        self.indices = pipeline.stage_indices(self.mesh["pp"].get_local_rank(), p)
        mine = [parts[i] for i in self.indices]
        view = pipeline.with_original_names(mine)  # before any wrapper renames a path
        if stored is not None:
            pretrained.materialized(stored, device, seed, self.sharding.init_fn, part=view)
        for part in mine:
            if p.tensor_parallel > 1:
                tensor_parallel.parallelize(part, p.plan, self.mesh["tp"], strict=False)
            if self.sharding.sharded:
                fsdp.shard(part, self.sharding, self.mesh["dp"], whole_ring=False)
            else:
                checkpoint_activations(part, self.sharding.activation_checkpointing, self.sharding.wrap)
        group = self.mesh["pp"].get_group()
        self.stages = [PipelineStage(part, i, p.stages, device, group=group) for part, i in zip(mine, self.indices)]
        for stage in self.stages:
            comm_spans.trace_stage(stage)
        self.checkpointer = fsdp.Checkpointer(self.store, self.run_id, self.sharding.async_checkpoint)
        return view

    @override
    def step(self, cfg: TrainConfig, device: torch.device, rank: int) -> Step:
        import torch.distributed as dist

        group = self.mesh["pp"].get_group()
        last = dist.get_global_rank(group, self.parallel.pipeline_parallel - 1)
        step = pipeline.PipelineStep(PlainStep(cfg, device, rank), None, first=0 in self.indices,
                                     last=self.parallel.stages - 1 in self.indices, pp=(group, last))
        step.schedule = pipeline.schedule_for(self.stages, self.parallel, step.loss)
        return step

    @override
    def norm_group(self) -> Any:
        return self.mesh["pp"].get_group()

    def compiled(self, model: torch.nn.Module, options: Optional[Dict[str, Any]]) -> Any:
        """The schedule runs the stages, not ``model``: each stage module's forward is compiled in
        place (the module stays itself for FSDP2 and the schedule; nn.Module.compile, which compiles
        ``_call_impl``, leaves torch 2.13's stages eager)."""
        if options is not None:
            for stage in self.stages:
                stage.submod.forward = torch.compile(stage.submod.forward, **options)
        return model

    @override
    def gather(self, model: torch.nn.Module) -> Optional[Dict[str, torch.Tensor]]:
        self.finish()
        return pipeline.gather_full_state(model, self._speaks_for_its_stages())

    @override
    def write_fitted(self, model: torch.nn.Module, store: Any, directory: str) -> None:
        self.finish()
        pp = self.mesh["pp"]
        pipeline.write_stages(model, self._speaks_for_its_stages(), pp.get_local_rank(), pp.size(), store, directory)

    def _speaks_for_its_stages(self) -> bool:
        """Whether this rank is the one of its pipeline position that hands its stages' whole state on."""
        return self.mesh["dp"].get_local_rank() == 0 and self.mesh["tp"].get_local_rank() == 0


def placement_for(cfg: TrainConfig, pretrained_model: bool = False) -> Placement:
    """The placement the fit's degrees and strategy name (``pretrained_model``: checkpoints as DCP).

    >>> type(placement_for(cfg)).__name__  # strategy="fsdp"  # doctest: +SKIP
    'Sharded'
    """
    return PlacementConfig.of(cfg, dcp_checkpoints=pretrained_model).build()


def _pipeline_example(cfg: TrainConfig, device: torch.device) -> tuple:
    """One microbatch of forward()'s arguments, for torch's tracer (which cuts a pipeline's model)."""
    rows = cfg.batch_size // cfg.parallel.microbatch_count
    batch = next(iter(run_batches(cfg, "train", batch_size=rows, rank=0, size=1, epoch=0, steps=1, shuffle=False,
                                  drop_last=True, workers=0, device=device)))
    return tuple(a.to(device) for a in cfg.spec.model_args(batch)[0])
