"""The estimator's Params as one typed, frozen value (EstimatorConfig), built once a fit from the Param table.

Every Param of ``params.PARAMS`` is a field here under its snake_case name (``batchSize`` ->
``batch_size``); what several layers derive from the Params (the columns as lists, the model-parallel
degrees, the sharding, the elastic switch) is a property, decided here once. The checks, the launch,
the text path, the model and the Tuner read these fields; only ``params.py`` reads a Param by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Literal, Optional, Tuple, Union, get_args

from ..trainer.activation import ActivationCheckpointing
from ..trainer.config import (
    Compression,
    LearningRateScaling,
    LightningBatch,
    ModelParallel,
    OnNonFinite,
    PipelineSchedule,
    Precision,
    Sharding,
    Strategy,
)
from ..trainer.pretrained import HuggingFaceDirectory
from .text_inference import InferenceMode
from .tracking import MlflowLogging

Columns = Union[str, List[str]]
# what a fit on a text column trains (the task Param)
Task = Literal["causal-lm", "sequence-classification", "masked-lm"]
TASKS: Tuple[Task, ...] = get_args(Task)


@dataclass(frozen=True)
class EstimatorConfig:
    """Every Param's value, typed (see docs/params.md for what each does), and what follows from them.

    >>> config = SparkRingEstimator(tensorParallel=2, labelCol=["a", "b"]).config()  # doctest: +SKIP
    >>> config.model_parallel.group_size, config.label_columns  # doctest: +SKIP
    (2, ['a', 'b'])
    """

    # what trains
    model: Any = None
    initial_weights: Optional[str] = None
    optimizer: Any = None
    loss: Any = None
    metrics: Any = None
    # the DataFrame's columns and how rows become model inputs
    features_col: Columns = "features"
    label_col: Columns = "label"
    prediction_col: Columns = "prediction"
    probability_col: str = "probability"
    raw_prediction_col: str = "rawPrediction"
    sample_weight_col: Optional[str] = None
    model_inputs: Any = None
    input_shapes: Any = None
    # text
    text_col: Optional[str] = None
    tokenizer: Any = None
    sequence_length: int = 512
    pack_sequences: bool = True
    task: Optional[Task] = None
    lora: Any = None
    merge_adapters: bool = False
    peak_flops: Optional[float] = None
    transform_fn: Optional[Callable] = None
    transform_fn_inference: Optional[Callable] = None
    reader_workers: Optional[int] = None
    # the schedule
    batch_size: int = 32
    val_batch_size: Optional[int] = None
    epochs: int = 1
    num_proc: Optional[int] = None
    validation: Union[None, float, str] = None
    shuffle: bool = True
    seed: int = 0
    # where ranks run
    backend: str = "auto"
    use_gpu: Optional[bool] = None
    ranks_per_task: Optional[int] = None
    resource_profile: Any = "auto"
    store: Any = None
    run_id: Optional[str] = None
    # how the model lives on the ranks
    strategy: Strategy = "ddp"
    fsdp_wrap: Optional[List[str]] = None
    init_fn: Optional[Callable] = None
    cpu_offload: bool = False
    async_checkpoint: bool = False
    tensor_parallel: int = 1
    parallelize_plan: Any = None
    pipeline_parallel: int = 1
    pipeline_split: Optional[List[str]] = None
    pipeline_schedule: PipelineSchedule = "1f1b"
    microbatches: Optional[int] = None
    activation_checkpointing: ActivationCheckpointing = "none"
    # the step
    gradient_clip_norm: Optional[float] = None
    backward_passes_per_step: int = 1
    compile: Union[bool, Dict[str, Any]] = False
    gradient_compression: Compression = "none"
    precision: Precision = "32"
    learning_rate_scaling: LearningRateScaling = "none"
    warmup_epochs: float = 0.0
    train_steps_per_epoch: Optional[int] = None
    validation_steps_per_epoch: Optional[int] = None
    callbacks: Optional[List[Any]] = None
    early_stopping: Any = None
    on_non_finite: OnNonFinite = "raise"
    lightning_batch: LightningBatch = "tuple"
    reader: str = "arrow"
    verbose: int = 1
    # transform()
    inference: InferenceMode = "predict"
    generation: Optional[Dict[str, Any]] = None
    inference_batch_size: int = 1024
    # data, time limits, elastic fits, logs
    read_in_place: bool = True
    keep_data: bool = False
    timeout: Optional[float] = None
    timeline: Optional[str] = None
    start_timeout: float = 120.0
    heartbeat_timeout: Optional[float] = 30.0
    min_proc: Optional[int] = None
    checkpoint_every: Optional[int] = None
    max_restarts: int = 3
    stream_logs: bool = True
    shared_memory: bool = True
    loss_weights: Optional[List[float]] = None
    mlflow_logging: MlflowLogging = "auto"

    @property
    def model_or_factory(self) -> Any:
        """The model Param as the ranks build it: a checkpoint directory's path becomes its
        from_pretrained factory (HuggingFaceDirectory), read with the Store's storage options."""
        if not isinstance(self.model, str):
            return self.model
        return HuggingFaceDirectory(self.model, self.storage_options)

    @property
    def storage_options(self) -> Dict[str, Any]:
        """The Store's storage options (an object store's endpoint and credentials), for weights behind URLs."""
        return dict(getattr(self.store, "storage_options", None) or {})

    @property
    def feature_columns(self) -> List[str]:
        """featuresCol as a list."""
        return [self.features_col] if isinstance(self.features_col, str) else list(self.features_col)

    @property
    def label_columns(self) -> List[str]:
        """labelCol as a list (one entry per model head)."""
        return [self.label_col] if isinstance(self.label_col, str) else list(self.label_col)

    @property
    def losses(self) -> List[Any]:
        """loss as a list, one per head (a single loss serves every head)."""
        if isinstance(self.loss, (list, tuple)):
            return list(self.loss)
        return [self.loss] * len(self.label_columns)

    @property
    def prediction_columns(self) -> List[str]:
        """predictionCol as a list: one per head (``<label>_<predictionCol>`` when several heads share one name)."""
        labels = self.label_columns
        if isinstance(self.prediction_col, str):
            return [self.prediction_col] if len(labels) == 1 else [f"{label}_{self.prediction_col}" for label in labels]
        return list(self.prediction_col)

    @property
    def transform_fn_for_inference(self) -> Optional[Callable]:
        """The transformFn transform() runs: transformFnInference, else transformFn."""
        return self.transform_fn_inference or self.transform_fn

    @property
    def model_parallel(self) -> ModelParallel:
        """How the model's layers are split across ranks (tensor and pipeline degrees)."""
        return ModelParallel(tensor_parallel=self.tensor_parallel, plan=self.parallelize_plan,
                             pipeline_parallel=self.pipeline_parallel, pipeline_split=tuple(self.pipeline_split or ()),
                             schedule=self.pipeline_schedule, microbatches=self.microbatches)

    @property
    def sharding(self) -> Sharding:
        """How the data-parallel ranks hold the model (replicated or sharded) and what a sharded model keeps."""
        return Sharding(strategy=self.strategy, wrap=tuple(self.fsdp_wrap or ()), init_fn=self.init_fn,
                        async_checkpoint=self.async_checkpoint, cpu_offload=self.cpu_offload,
                        bf16_compute=self.precision == "bf16-mixed",
                        activation_checkpointing=self.activation_checkpointing)

    @property
    def elastic(self) -> bool:
        """minProc or checkpointEvery asks for an elastic fit."""
        return self.min_proc is not None or self.checkpoint_every is not None

    @property
    def compile_options(self) -> Optional[Dict[str, Any]]:
        """compile as torch.compile's keyword arguments (None: eager)."""
        if self.compile is True:
            return {}
        return dict(self.compile) if isinstance(self.compile, dict) else None

    @property
    def validation_batch_size(self) -> int:
        """Rows per validation batch: valBatchSize, else batchSize."""
        return self.val_batch_size or self.batch_size
