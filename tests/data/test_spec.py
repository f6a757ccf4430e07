"""The feature spec (columns to tensors), run ids, the transform contract (fast layer)."""
import numpy as np
import pytest
import torch
from pyspark.ml.linalg import VectorUDT
from pyspark.sql import types as T

from sparkring.data.spec import FeatureSpec, to_numpy
from sparkring.data.store import check_run_id
from sparkring.data.transform import apply
from sparkring.errors import ConfigurationError, DataError

SCHEMA = T.StructType([
    T.StructField("user", T.IntegerType()), T.StructField("item", T.LongType()),
    T.StructField("age", T.DoubleType()), T.StructField("income", T.FloatType()),
    T.StructField("vec", VectorUDT()), T.StructField("grid", T.ArrayType(T.ArrayType(T.DoubleType()))),
    T.StructField("png", T.BinaryType()), T.StructField("label", T.DoubleType()),
    T.StructField("name", T.StringType()),
])


def test_feature_spec_makes_int64_ids_float_concatenations_and_keyword_inputs():
    spec = FeatureSpec.build(SCHEMA, inputs=["user", "item", ["age", "income"]], labels=["label"])
    assert [(i.name, i.integral) for i in spec.inputs] == [("user", True), ("item", True), ("age+income", False)]
    batch = {"user": np.array([1, 2], np.int32), "item": np.array([3, 4], np.int64),
             "age": np.array([0.5, 1.5]), "income": np.array([2.0, 3.0], np.float32)}
    args, kwargs = spec.model_args(batch)
    assert [a.dtype for a in args] == [torch.int64, torch.int64, torch.float32] and kwargs == {}
    assert args[2].tolist() == [[0.5, 2.0], [1.5, 3.0]]
    keyword = FeatureSpec.build(SCHEMA, inputs={"ids": "user", "dense": ["age"]})
    args, kwargs = keyword.model_args(batch)
    assert args == () and set(kwargs) == {"ids", "dense"} and kwargs["dense"].shape == (2, 1)


def test_feature_spec_round_trips_through_metadata_and_reshapes_by_input_shapes():
    spec = FeatureSpec.build(SCHEMA, features=["vec"], labels=["label"], shapes=[1, 2, 2]).measured({"vec": [4]})
    assert FeatureSpec.from_dict(spec.to_dict()) == spec
    (x,), _ = spec.model_args({"vec": np.arange(8, dtype=np.float32).reshape(2, 4)})
    assert x.shape == (2, 1, 2, 2)
    with pytest.raises(DataError, match=r"inputShapes\['vec'\]=\[3\] holds 3 elements but column\(s\) \['vec'\] "
                                        r"give 4 per row"):
        FeatureSpec.build(SCHEMA, features=["vec"], shapes=[3]).measured({"vec": [4]})


@pytest.mark.parametrize("kw,match", [
    ({"inputs": ["user", "nope"]}, r"modelInputs names column 'nope'"),
    ({"inputs": ["png"]}, r"column 'png' \(input 'png'\) is binary: pass transformFn="),
    ({"inputs": ["name"]}, r"column 'name' has type string.*StringIndexer"),
    ({"inputs": ["age"], "shapes": {"other": [1]}}, r"inputShapes names \['other'\], which are not model inputs"),
    ({"inputs": ["age", "user"], "shapes": [1]}, r"is one shape but the model has 2 inputs"),
    ({"inputs": [["age", "income"]], "shapes": {"age+income": [3]}}, r"holds 3 elements but .* give 2"),
])
def test_feature_spec_refuses_bad_inputs_naming_the_column(kw, match):
    with pytest.raises(DataError, match=match):
        FeatureSpec.build(SCHEMA, **kw)


def test_arrow_columns_decode_the_same_stored_or_raw():
    import pyarrow as pa

    spec = FeatureSpec.build(SCHEMA, inputs=["grid"]).measured({"grid": [2, 2]})
    raw = pa.array([[[1.0, 2.0], [3.0, 4.0]], [[5.0, 6.0], [7.0, 8.0]]])
    from sparkring.data.spec import to_stored

    col = spec.column("grid")
    assert to_numpy(raw, col).tolist() == to_numpy(to_stored(raw, col), col).tolist()
    assert to_numpy(raw, col).shape == (2, 2, 2)


def test_run_ids_must_be_plain_names():
    check_run_id("run-1.a_b")
    for bad in ("../escape", "a/b", "", ".hidden", "x" * 200):
        with pytest.raises(ConfigurationError, match="is not a plain name"):
            check_run_id(bad)


def test_transform_results_replace_entries_and_must_be_dicts():
    out = apply(lambda b: {"x": b["x"] * 2, "new": 1}, {"x": np.ones(2), "y": np.zeros(2)})
    assert out["x"].tolist() == [2.0, 2.0] and out["y"].tolist() == [0.0, 0.0] and out["new"] == 1
    with pytest.raises(TypeError, match="transformFn returned list, not a dict"):
        apply(lambda b: [b], {"x": np.ones(1)})
