"""SparkRingEstimator: the pyspark.ml Estimator that fits a torch model on a DataFrame (data, tensor and
pipeline parallel); each fit runs as the steps of fitting.py."""
from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type

from pyspark import keyword_only
from pyspark.ml import Estimator
from pyspark.ml.util import MLReadable, MLWritable
from typing_extensions import override

from . import tracking
from .fitting import FitContext, GridPoint, fit
from .model import SparkRingModel
from .params import SparkRingParams, signature, unknown_params
from .persistence import SparkRingReader, SparkRingWriter


class SparkRingEstimator(Estimator, SparkRingParams, MLReadable, MLWritable):
    """Trains a torch.nn.Module on a Spark DataFrame: data parallel (replicated or sharded), tensor, pipeline.

    >>> est = SparkRingEstimator(
    ...     model=torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)),
    ...     optimizer=lambda params: torch.optim.Adam(params, lr=1e-3),
    ...     loss="cross_entropy", featuresCol="features", labelCol="label",
    ...     batchSize=64, epochs=5, numProc=2, validation=0.1)
    >>> model = est.fit(train_df)  # doctest: +SKIP
    >>> model.transform(test_df).select("prediction").show()  # doctest: +SKIP
    """

    _input_kwargs: Dict[str, Any]  # set by pyspark's keyword_only
    fitted_type: Type[SparkRingModel] = SparkRingModel  # the class fit() returns (a subclass may return its own)

    @keyword_only
    def __init__(self, **params: Any) -> None:
        # the keyword-only signature (names, types, defaults) comes from params.PARAMS: see below
        unknown_params(params)
        super().__init__()
        self._set(**{k: v for k, v in self._input_kwargs.items()})

    @keyword_only
    def setParams(self, **kwargs):
        """Set several Params at once; returns self.

        >>> est.setParams(epochs=3, batchSize=128)  # doctest: +SKIP
        """
        unknown_params(self._input_kwargs)
        return self._set(**self._input_kwargs)

    def _fit(self, dataset):
        return fit(self._fit_context(dataset), dataset)

    def _fit_context(self, dataset) -> FitContext:
        """The context a fit of ``dataset`` starts from (a subclass may add to it)."""
        return FitContext(config=self.config(), spark=dataset.sparkSession, model_type=self.fitted_type)

    def fitMultiple(self, dataset, paramMaps):
        """Fit one model per param map; data is prepared once and shared by every fit
        (CrossValidator and TrainValidationSplit call this), then deleted unless keepData.

        >>> for index, model in est.fitMultiple(df, grid):  # doctest: +SKIP
        ...     print(index, model.history[-1])
        """
        # CrossValidator calls this on the user's thread and fits on pool threads, where the
        # user's MLflow run is not active: each grid point becomes a child run of it
        config = self.config()
        parent = tracking.active_run_id() if config.mlflow_logging != "off" else None
        return _GridFits(self, paramMaps, dataset, parent_run=parent, keep_data=config.keep_data)

    # -- persistence ------------------------------------------------------------------
    @override
    def write(self):
        return SparkRingWriter(self)

    @classmethod
    @override
    def read(cls):
        return SparkRingReader(cls)

    def _after_load(self, metadata, store) -> None:
        """An estimator is its Params: nothing beyond them to restore."""


SparkRingEstimator.__init__.__signature__ = signature(SparkRingEstimator)  # type: ignore[attr-defined]


class _GridFits:
    """fitMultiple's iterator: (index, model) per param map, safe to call from several threads (as
    CrossValidator's pool does); the data the fits shared is deleted once the last one ends."""

    def __init__(self, estimator: SparkRingEstimator, param_maps: Sequence[Dict[Any, Any]], dataset, *,
                 parent_run: Optional[str], keep_data: bool):
        # a param map is read when its fit begins, on the thread that runs it (the Tuner's are made then)
        self._estimator, self._param_maps, self._dataset = estimator, param_maps, dataset
        self._parent_run, self._keep_data = parent_run, keep_data
        self._contexts: List[FitContext] = []
        self._lock = threading.Lock()
        self._next = self._done = 0

    def __iter__(self) -> "_GridFits":
        return self

    def __next__(self) -> Tuple[int, SparkRingModel]:
        with self._lock:
            index = self._next
            if index >= len(self._param_maps):
                raise StopIteration
            self._next += 1
        grid_point = GridPoint(self._parent_run, index) if self._parent_run is not None else None
        try:
            config = self._estimator.copy(self._param_maps[index]).config()
            context = FitContext(config=config, spark=self._dataset.sparkSession, hold_data=True,
                                 grid_point=grid_point, model_type=self._estimator.fitted_type)
            with self._lock:
                self._contexts.append(context)
            return index, fit(context, self._dataset)
        finally:
            with self._lock:
                self._done += 1
                last = self._done == len(self._param_maps)
            if last and not self._keep_data:
                self._delete_shared()

    def _delete_shared(self) -> None:
        with self._lock:
            prepared = [context.prepared for context in self._contexts if context.prepared is not None]
        for ds in {ds.data_dir: ds for ds in prepared}.values():
            ds.delete()
