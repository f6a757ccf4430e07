"""One batch of input columns -> the prediction columns: what transform() runs in each Spark
task and what the MLflow pyfunc model runs on a pandas DataFrame, decided once per model."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import pandas as pd
import pyarrow as pa
import torch

from ..data import FeatureSpec
from ..data.reader import as_torch
from ..data.spec import to_numpy
from ..data.transform import apply as apply_transform
from ..trainer import losses
from ..trainer.lightning import inference_call


@dataclass(frozen=True)
class OutputField:
    """One field of the prediction struct: ``name`` inside the struct, ``column`` in the result."""

    name: str
    column: str
    is_list: bool

    @property
    def arrow_type(self) -> pa.DataType:
        """The output column's Arrow type (a list of doubles, or a double)."""
        return pa.list_(pa.float64()) if self.is_list else pa.float64()

    @property
    def spark_type(self) -> str:
        """The output column's type as Spark SQL spells it."""
        return "array<double>" if self.is_list else "double"


@dataclass(frozen=True)
class Predictor:
    """The inference recipe of a fitted model (not the weights): which columns feed forward()
    and how each head's output becomes prediction columns.

    >>> predictor = model._predictor(df)  # doctest: +SKIP
    >>> predictor.predict_pandas(net, torch.device("cpu"), pdf)  # doctest: +SKIP
    """

    spec: FeatureSpec
    loss_list: Tuple[Any, ...]
    fields: Tuple[OutputField, ...]
    batch_size: int
    transform_fn: Optional[Callable] = None

    @property
    def single_classifier(self) -> bool:
        """prediction, probability and rawPrediction of one classification head (output_fields)."""
        return self.fields[0].name == "prediction"

    @property
    def input_columns(self) -> List[str]:
        """The columns the model reads, in the fitted spec's order."""
        return [c.name for c in self.spec.columns]

    def struct_type(self) -> pa.DataType:
        """The Arrow struct of every output column."""
        return pa.struct([(f.name, f.arrow_type) for f in self.fields])

    def spark_schema(self) -> str:
        """The output columns as a Spark DDL schema."""
        return ", ".join(f"{f.name} {f.spark_type}" for f in self.fields)

    def model_args(self, arrays: Sequence[pa.Array]) -> Tuple[tuple, dict]:
        """forward()'s arguments (CPU tensors) for Arrow arrays of the input columns."""
        batch = {c.name: to_numpy(a, c) for c, a in zip(self.spec.columns, arrays)}
        if self.transform_fn is not None:
            batch = apply_transform(self.transform_fn, batch)
        return self.spec.model_args(as_torch(batch))

    def forward(self, model: torch.nn.Module, device: torch.device, arrays: Sequence[pa.Array]) -> List[np.ndarray]:
        """One array per output field, ``len(arrays[0])`` rows each, in ``inferenceBatchSize`` passes."""
        args, kwargs = self.model_args(arrays)
        n = len(arrays[0])
        single = len(self.loss_list) == 1
        outs: List[List[torch.Tensor]] = [[] for _ in self.loss_list]
        call = inference_call(model)
        with torch.no_grad():
            for start in range(0, n, self.batch_size):
                end = start + self.batch_size
                out = call(*(a[start:end].to(device) for a in args),
                           **{k: v[start:end].to(device) for k, v in kwargs.items()})
                heads = [out] if single else list(out)[:len(self.loss_list)]
                for i, head in enumerate(heads):
                    outs[i].append(head.float().cpu())
        columns: List[np.ndarray] = []
        for loss, head in zip(self.loss_list, outs):
            preds = losses.predictions(loss, torch.cat(head))
            if self.single_classifier:
                columns += [preds[name].numpy() for name in ("prediction", "probability", "rawPrediction")]
            else:
                columns.append(preds["prediction"].numpy())
        return columns

    def to_arrow(self, columns: List[np.ndarray], n: int) -> pa.Array:
        """The model's outputs ``columns`` for ``n`` rows as one Arrow struct array."""
        out = []
        for values, f in zip(columns, self.fields):
            if not f.is_list:
                out.append(pa.array(values.reshape(n), type=pa.float64()))
            else:
                k = values.reshape(n, -1).shape[1]
                offsets = pa.array(np.arange(0, (n + 1) * k, k, dtype=np.int32))
                out.append(pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1), type=pa.float64())))
        return pa.StructArray.from_arrays(out, names=[f.name for f in self.fields])

    def predict_pandas(self, model: torch.nn.Module, device: torch.device, frame: pd.DataFrame) -> pd.DataFrame:
        """The prediction columns (named as transform() names them) for a pandas DataFrame
        holding the input columns by name, or exactly those columns in order (as
        ``mlflow.pyfunc.spark_udf`` passes unnamed arguments); vectors may be arrays or lists."""
        names = self.input_columns
        if all(name in frame.columns for name in names):
            series = [frame[name] for name in names]
        elif len(frame.columns) == len(names):
            series = [frame[c] for c in frame.columns]
        else:
            raise ValueError(f"the model reads columns {names}; the input has {list(frame.columns)}: pass those "
                             "columns (by name, or exactly them in this order)")
        n = len(frame)
        if n == 0:
            return pd.DataFrame({f.column: [] for f in self.fields})
        columns = self.forward(model, device, [pandas_to_arrow(s) for s in series])
        return pd.DataFrame({f.column: list(v) if v.ndim > 1 else v for f, v in zip(self.fields, columns)},
                            index=frame.index)


def pandas_to_arrow(series: pd.Series) -> pa.Array:
    """A pandas column as Arrow: numbers as they are; arrays, lists and ML vectors (toArray) as lists."""
    if series.dtype != object:
        return pa.array(series)
    return pa.array([v.toArray() if hasattr(v, "toArray") else v for v in series])


def output_fields(loss_list: Sequence[Any], kinds: Sequence[Tuple[str, int]], prediction_columns: Sequence[str],
                  probability_col: str, raw_prediction_col: str) -> Tuple[OutputField, ...]:
    """The prediction struct: a single classifier's prediction, probability and raw scores;
    otherwise one field per head (a list where a regression head is wider than 1)."""
    if len(loss_list) == 1 and kinds[0][0] == "classification":
        return (OutputField("prediction", prediction_columns[0], False),
                OutputField("probability", probability_col, True),
                OutputField("rawPrediction", raw_prediction_col, True))
    return tuple(OutputField(f"h{i}", column, not (kind == "classification" or width == 1))
                 for i, ((kind, width), column) in enumerate(zip(kinds, prediction_columns)))
