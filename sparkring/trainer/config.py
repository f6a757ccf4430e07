"""What one fit asks of its ranks, decided once on the driver: TrainConfig and the choices it holds."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Literal, Optional, Tuple, Union, get_args

import torch

from sparkring.data import FeatureSpec

from .activation import ActivationCheckpointing
from .elastic import ElasticPlan

# The choices of a fit, each one Literal that the Param table (its allowed values), the checks and the
# Param reference share.
Strategy = Literal["ddp", "fsdp", "hsdp"]
STRATEGIES: Tuple[Strategy, ...] = get_args(Strategy)
Precision = Literal["32", "bf16-mixed", "16-mixed"]
PRECISIONS: Tuple[Precision, ...] = get_args(Precision)
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved-1f1b"]
PIPELINE_SCHEDULES: Tuple[PipelineSchedule, ...] = get_args(PipelineSchedule)
Compression = Literal["none", "fp16", "bf16"]
COMPRESSIONS: Tuple[Compression, ...] = get_args(Compression)
LearningRateScaling = Literal["none", "linear"]
LR_SCALINGS: Tuple[LearningRateScaling, ...] = get_args(LearningRateScaling)
OnNonFinite = Literal["raise", "skip_step"]
ON_NON_FINITE: Tuple[OnNonFinite, ...] = get_args(OnNonFinite)
LightningBatch = Literal["tuple", "dict"]  # a LightningModule's batch: (inputs..., labels...) or {column: tensor}
LIGHTNING_BATCHES: Tuple[LightningBatch, ...] = get_args(LightningBatch)

ModelOrFactory = Union[torch.nn.Module, Callable[[], torch.nn.Module]]
OptimizerOrFactory = Union[torch.optim.Optimizer, Callable[[Any], torch.optim.Optimizer]]


def is_factory(model: Any) -> bool:
    """``model=`` is a zero-argument callable that builds the module (on every rank).

    >>> is_factory(lambda: torch.nn.Linear(2, 1)), is_factory(torch.nn.Linear(2, 1))
    (True, False)
    """
    return callable(model) and not isinstance(model, torch.nn.Module)


@dataclass(frozen=True)
class EarlyStopping:
    """The earlyStopping Param, checked: stop once ``monitor`` has not improved by ``min_delta``
    for ``patience`` epochs (``mode`` "min" or "max").

    >>> EarlyStopping(monitor="val_loss", patience=2).mode
    'min'
    """

    monitor: str
    patience: int
    mode: str = "min"
    min_delta: float = 0.0


@dataclass(frozen=True)
class Sharding:
    """How fit() places the model: replicated (``ddp``) or sharded (``fsdp``, ``hsdp``).

    >>> Sharding(strategy="fsdp", wrap=("TransformerEncoderLayer",)).sharded
    True
    """

    strategy: Strategy = "ddp"
    wrap: Tuple[str, ...] = ()        # module class names sharded as units (default: see fsdp.wrap_units)
    init_fn: Optional[Callable[[torch.nn.Module], None]] = None
    async_checkpoint: bool = False    # write sharded checkpoints while training goes on
    cpu_offload: bool = False         # shards live in CPU memory between uses (FSDP2's CPUOffloadPolicy)
    bf16_compute: bool = False        # precision="bf16-mixed": bfloat16 parameters in compute, float32 reduction
    activation_checkpointing: ActivationCheckpointing = "none"  # recompute blocks' activations in backward

    @property
    def sharded(self) -> bool:
        """Whether the parameters are sharded (every strategy but ddp)."""
        return self.strategy != "ddp"


@dataclass(frozen=True)
class ModelParallel:
    """How the model's layers are split across ranks, on one (pp, dp, tp) mesh: ``tensor_parallel``
    ranks per group (inside a host) hold a slice of each planned layer (``plan``: see
    tensor_parallel); ``pipeline_parallel`` stages hold consecutive layers (split where
    ``pipeline_split`` names, or by parameter count) and pass ``microbatches`` through ``schedule``
    (see pipeline). ``Sharding.strategy`` acts on dp, the ranks that read different rows.

    >>> ModelParallel(tensor_parallel=2, pipeline_parallel=2).data_size(world=8)
    2
    """

    tensor_parallel: int = 1
    plan: Any = None                  # tensor_parallel.Plan: a dict of module patterns to styles, or a callable
    pipeline_parallel: int = 1
    pipeline_split: Tuple[str, ...] = ()  # module names where stages 1.. begin (empty: balanced by parameters)
    schedule: PipelineSchedule = "1f1b"
    microbatches: Optional[int] = None  # per step (default: pipeline_parallel)

    @property
    def enabled(self) -> bool:
        """Some layer is split across ranks (tensor- or pipeline-parallel)."""
        return self.tensor_parallel > 1 or self.pipeline_parallel > 1

    @property
    def group_size(self) -> int:
        """Ranks that train one replica together (and are lost together): tensor x pipeline degrees."""
        return self.tensor_parallel * self.pipeline_parallel

    def data_size(self, world: int) -> int:
        """Ranks that read different rows (a tensor-parallel group, a pipeline's stages read the same ones)."""
        return world // self.group_size

    @property
    def stages_per_rank(self) -> int:
        """Interleaved 1F1B loops over two stages on each rank (virtual stages); the others one."""
        return 2 if self.schedule == "interleaved-1f1b" else 1

    @property
    def stages(self) -> int:
        """How many pipeline stages the model is cut into."""
        return self.pipeline_parallel * self.stages_per_rank

    @property
    def microbatch_count(self) -> int:
        """How many microbatches a batch is split into (as many as pipeline ranks unless set)."""
        return self.microbatches or self.pipeline_parallel


@dataclass(frozen=True)
class LightningTrainerSettings:
    """What Lightning's own Trainer gets on every rank where it fits a LightningModule
    (trainer.lightning_trainer; Horovod's Lightning estimator): its callbacks, logger (None: a
    TensorBoard logger into the run's logs), profiler and further arguments, which win.

    >>> LightningTrainerSettings(callbacks=(LearningRateMonitor(),), trainer_args={"max_epochs": 3})  # doctest: +SKIP
    """

    callbacks: Tuple[Any, ...] = ()
    trainer_args: Dict[str, Any] = field(default_factory=dict)
    logger: Any = None
    profiler: Any = None
    log_every_n_steps: int = 50
    terminate_on_nan: bool = False    # Lightning 1.x's: a non-finite training loss ends the fit


@dataclass
class TrainConfig:
    """Everything a rank needs to train, built once by the estimator from its Params.

    >>> TrainConfig.__dataclass_fields__["precision"].default
    '32'
    """

    model: ModelOrFactory
    optimizer: OptimizerOrFactory
    losses: List[Any]                 # a loss name (losses.NAMED) or a callable(output, label), per head
    metrics: Dict[str, Callable]
    dataset: Any                      # sparkring.data.Dataset (its batches() and global_batches())
    store: Any                        # sparkring.data.Store
    run_id: str
    spec: FeatureSpec
    loss_weights: List[float]
    batch_size: int
    val_batch_size: int
    epochs: int
    shuffle: bool
    seed: int
    backward_passes_per_step: int
    compression: Compression
    lr_scaling: LearningRateScaling
    warmup_epochs: float
    train_steps: int                  # steps of each rank's epoch (a multiple of backward_passes_per_step)
    val_steps: int                    # validation steps of each rank's epoch (0: no validation)
    callbacks: List[Any] = field(default_factory=list)
    early_stopping: Optional[EarlyStopping] = None
    use_gpu: bool = False
    has_validation: bool = False
    transform_fn: Optional[Callable] = None
    reader_workers: Optional[int] = None
    reader: str = "arrow"             # data.READERS
    multi_head: bool = False
    skip_non_finite: bool = False
    gradient_clip_norm: Optional[float] = None  # the gradients' global norm at most this before each step
    lightning: bool = False           # model is a LightningModule (trainer.lightning)
    lightning_batch: LightningBatch = "tuple"  # how its steps get a batch
    sharding: Sharding = field(default_factory=Sharding)
    parallel: ModelParallel = field(default_factory=ModelParallel)
    precision: Precision = "32"
    compile: Optional[Dict[str, Any]] = None  # torch.compile's options (None: eager)
    elastic: Optional[ElasticPlan] = None     # world-size-independent global batches, checkpoints inside epochs
    initial_weights: Optional[str] = None     # stored values every rank reads its share of (trainer.pretrained)
    lightning_trainer: Optional[LightningTrainerSettings] = None  # a LightningModule fitted by Lightning's Trainer
    train_minibatch: Optional[Callable] = None  # Horovod's train_minibatch_fn: each batch's step (trainer.minibatch)

    def log_names(self) -> List[str]:
        """Names of the per-epoch figures after 'loss', in the order the step sums them."""
        if not self.multi_head:
            return list(self.metrics)
        return [f"{label}_{name}" for label in self.spec.labels for name in ["loss"] + list(self.metrics)]


def default_reader_workers(local_size: int) -> int:
    """Decode processes per rank: the cores each rank has left after its training thread, 1 to 4.

    >>> 1 <= default_reader_workers(local_size=2) <= 4
    True
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores // max(1, local_size) - 1))
