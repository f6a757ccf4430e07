"""A fitted SparkRingModel as an MLflow model: logged as a ``python_function`` (pyfunc) model
that predicts what transform() predicts (so ``mlflow.pyfunc.spark_udf`` scores it in Spark),
with the Spark ML model itself as an artifact (load_model gives it back). A PipelineModel that
holds one is logged with MLflow's own Spark flavour (``mlflow.spark``) and loads back as one.

The pyfunc is written here because neither MLflow flavour fits: ``mlflow.pytorch``'s pyfunc
takes one float tensor (no integer ids, several inputs, transformFn, or class probabilities),
and ``mlflow.spark``'s starts a local Spark session inside every executor to score.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any, Optional

import cloudpickle
import mlflow
import pandas as pd
import torch
from typing_extensions import override

from .estimator import SparkRingModel, exporting
from .estimator.tracking import pip_requirements
from .runner import to_bytes

_PREDICTOR = "predictor.pkl"
_SPARK_MODEL = "sparkring_model"


class SparkRingPyfunc(mlflow.pyfunc.PythonModel):  # type: ignore[name-defined]  # mlflow.pyfunc exports it lazily
    """What ``mlflow.pyfunc.load_model`` runs: the model's inference recipe and weights on CPU.

    >>> pyfunc = mlflow.pyfunc.load_model(info.model_uri)  # doctest: +SKIP
    >>> pyfunc.predict(pandas_df)  # prediction (probability, rawPrediction) columns  # doctest: +SKIP
    """

    @override
    def load_context(self, context) -> None:
        with open(context.artifacts["predictor"], "rb") as f:
            self.predictor, net_bytes = cloudpickle.loads(f.read())
        self.net = cloudpickle.loads(net_bytes)
        self.net.eval()
        self.spark_model_dir = context.artifacts.get("spark_model")

    @override
    def predict(self, context, model_input: pd.DataFrame, params: Optional[dict] = None) -> pd.DataFrame:
        return self.predictor.predict_pandas(self.net, torch.device("cpu"), model_input)


def log_model(model: Any, name: str = "model", df=None, **kwargs: Any):
    """Log a SparkRingModel (pyfunc + the Spark ML model) or a PipelineModel (mlflow.spark)
    into the active run; ``df`` (a few rows of the data to score) gives the input example and
    signature, and the input columns where the model was not fitted here. Returns MLflow's
    ModelInfo.

    >>> with mlflow.start_run():  # doctest: +SKIP
    ...     info = sparkring.mlflow.log_model(model, "model", df=test_df)
    >>> predict = mlflow.pyfunc.spark_udf(spark, info.model_uri, result_type="double")  # doctest: +SKIP
    >>> test_df.withColumn("prediction", predict("features"))  # doctest: +SKIP
    """
    from pyspark.ml import PipelineModel

    if isinstance(model, PipelineModel):
        from mlflow import spark as mlflow_spark

        return mlflow_spark.log_model(model, name, pip_requirements=pip_requirements(_PACKAGES + ["pyspark"]),
                                      **kwargs)
    if not isinstance(model, SparkRingModel):
        raise TypeError(f"log_model takes a SparkRingModel or a PipelineModel, got {type(model).__name__}")
    text = model.config().text_col is not None  # documents in: the tokenizer travels in the recipe
    predictor = model._text_predictor() if text else model._predictor(df)
    net_bytes = to_bytes(model.getModel())
    with tempfile.TemporaryDirectory() as tmp:
        predictor_path = os.path.join(tmp, _PREDICTOR)
        with open(predictor_path, "wb") as f:
            f.write(to_bytes((predictor, net_bytes)))
        spark_dir = os.path.join(tmp, _SPARK_MODEL)
        model.write().overwrite().save(spark_dir)
        example = None
        if df is not None:
            # vectors as arrays: what MLflow can describe in a signature and write as an example
            columns = [model.config().text_col] if text else [c.spark_column() for c in predictor.spec.columns]
            sample = df.select(*columns).limit(5).toPandas()
            example = _as_json_reads_it(sample) if not sample.empty else None
        if example is not None and "signature" not in kwargs and not text:
            from mlflow.models import infer_signature

            net = cloudpickle.loads(net_bytes).eval()
            kwargs["signature"] = infer_signature(example, predictor.predict_pandas(net, torch.device("cpu"), example))
        info = mlflow.pyfunc.log_model(name=name, python_model=SparkRingPyfunc(),
                                       artifacts={"predictor": predictor_path, "spark_model": spark_dir},
                                       input_example=example, pip_requirements=pip_requirements(_PACKAGES), **kwargs)
    if text and exporting.form_of(model.getModel()) == exporting.TRANSFORMERS:
        log_transformers_model(model, f"{name}-transformers")
    return info


def log_transformers_model(model: SparkRingModel, name: str = "transformers", **kwargs: Any):
    """Log a text fit's transformers model and its tokenizer with MLflow's own transformers flavour
    (``mlflow.transformers.load_model`` gives a pipeline back; log_model calls it for such fits,
    as ``<name>-transformers``). Returns MLflow's ModelInfo.

    >>> with mlflow.start_run():  # doctest: +SKIP
    ...     info = sparkring.mlflow.log_transformers_model(lm)
    >>> mlflow.transformers.load_model(info.model_uri)("the cat")  # doctest: +SKIP
    """
    from mlflow import transformers as mlflow_transformers

    module = model.getModel()
    if exporting.form_of(module) != exporting.TRANSFORMERS:
        raise TypeError(f"{type(module).__name__} is not a transformers model (a peft model: set mergeAdapters=True)")
    tokenizer = exporting.transformers_tokenizer(model.getOrDefault(model.tokenizer))
    components = {"model": module, **({"tokenizer": tokenizer} if tokenizer is not None else {})}
    task = {"causal-lm": "text-generation", "masked-lm": "fill-mask",
            "sequence-classification": "text-classification"}.get(model.config().task or "", None)
    kwargs.setdefault("pip_requirements", pip_requirements(["torch", "transformers", "tokenizers", "safetensors"]))
    return mlflow_transformers.log_model(components, name=name, task=task, **kwargs)


def load_model(model_uri: str) -> Any:
    """The SparkRingModel (or PipelineModel) logged by log_model.

    >>> model = sparkring.mlflow.load_model("runs:/<run id>/model")  # doctest: +SKIP
    >>> model.transform(df)  # doctest: +SKIP
    """
    from mlflow.models import get_model_info

    flavors = get_model_info(model_uri).flavors
    if "spark" in flavors:
        from mlflow import spark as mlflow_spark

        return mlflow_spark.load_model(model_uri)
    if "python_function" not in flavors or "sparkring_model" not in str(flavors["python_function"]):
        raise ValueError(f"{model_uri} was not logged by sparkring.mlflow.log_model")
    local = mlflow.artifacts.download_artifacts(model_uri)
    return SparkRingModel.load(os.path.join(local, "artifacts", _SPARK_MODEL))


def _as_json_reads_it(frame: pd.DataFrame) -> pd.DataFrame:
    """float32 arrays as float64: MLflow checks the example after a JSON round trip, which reads
    every float back as a double and then refuses to narrow it to the signature's float."""
    import numpy as np

    out = frame.copy()
    for name in out.columns:
        first = out[name].iloc[0]
        if isinstance(first, np.ndarray) and first.dtype == np.float32:
            out[name] = [np.asarray(v, dtype=np.float64) for v in out[name]]
    return out


# what the scoring side needs besides sparkring itself (not on PyPI: install it there as here)
_PACKAGES = ["torch", "cloudpickle", "pyarrow", "pandas", "numpy"]
