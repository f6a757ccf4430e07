"""Horovod's ``transformation_fn`` as a sparkring transformFn: the user's function of one row (a dict
column -> value, an array where the column holds a vector, as Petastorm's ``make_reader`` handed it
under Horovod's ``TransformSpec``) run on each row of each batch sparkring's reader yields.

Horovod ran it on the training and validation rows, not in ``TorchModel.transform()``: so does this
(the fitted model's transformFnInference leaves the batch as it is, ``untransformed``). Petastorm
needed ``transformation_edit_fields`` and ``transformation_removed_fields`` to know the new schema;
sparkring reads what the function returns and the model reads only its input and label columns, so
they are accepted and not needed.

>>> flip = RowTransformation(lambda row: {**row, "y": 1 - row["y"]})
>>> flip({"y": np.array([0.0, 1.0])})["y"]  # doctest: +SKIP
array([1., 0.])
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping

import numpy as np

Batch = Dict[str, Any]


def rows_of(batch: Batch) -> List[Dict[str, Any]]:
    """A batch of column arrays as its rows, each a dict column -> that row's value.

    >>> rows_of({"x": np.zeros((2, 3)), "y": np.array([1.0, 2.0])})[1]["y"]  # doctest: +SKIP
    2.0
    """
    count = len(next(iter(batch.values()))) if batch else 0
    return [{name: values[i] for name, values in batch.items()} for i in range(count)]


def batch_of(rows: List[Mapping[str, Any]]) -> Batch:
    """Rows back as a batch: each column's values stacked into one array (rows of one shape).

    >>> batch_of([{"x": np.zeros(3)}, {"x": np.ones(3)}])["x"].shape  # doctest: +SKIP
    (2, 3)
    """
    if not rows:
        return {}
    return {name: np.stack([np.asarray(row[name]) for row in rows]) for name in rows[0]}


@dataclass(frozen=True)
class RowTransformation:
    """A transformFn that runs Horovod's ``transformation_fn(row: dict) -> dict`` on each row of a
    batch; the columns it returns replace the batch's.

    >>> SparkRingEstimator(transformFn=RowTransformation(scale_pixels))  # doctest: +SKIP
    """

    function: Callable[[Dict[str, Any]], Mapping[str, Any]]

    def __call__(self, batch: Batch) -> Batch:
        """The batch's rows, each through the function, stacked back into columns."""
        out = []
        for row in rows_of(batch):
            changed = self.function(row)
            if not isinstance(changed, Mapping):
                raise TypeError(f"transformation_fn returned {type(changed).__name__}, not a dict: return the row "
                                "(a dict column -> value), as Petastorm's TransformSpec wants it")
            out.append(changed)
        return batch_of(out)


def untransformed(batch: Batch) -> Batch:
    """The fitted model's transformFnInference: Horovod's TorchModel scores rows as they are.

    >>> untransformed({"x": 1})
    {}
    """
    return {}
