"""Reading petastorm's Unischema without petastorm: only its schema and codec classes unpickle."""
import os
import pickle

import numpy as np
import pyarrow.parquet as pq
import pytest
from paths import DATA

from sparkring.data import DataError
from sparkring.data.unischema import UNISCHEMA_KEY, Codec, parse_unischema, read_unischema

pytestmark = pytest.mark.compat  # version-dependent throughout (make test-compat)

FIXTURE = os.path.join(DATA, "petastorm_dataset")


def test_the_unischema_petastorm_wrote_gives_each_codec_field_its_dtype_and_shape():
    codecs = read_unischema("file://" + os.path.join(FIXTURE, "_common_metadata"))
    assert codecs == {"mat": Codec("ndarray", "float32", (4, 4)), "img": Codec("png", "uint8", (8, 8, 3)),
                      "thumb": Codec("jpeg", "uint8", (6, 6))}


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_unischema_blob_that_would_run_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    blob = pickle.dumps({"_fields": _RunsCode(marker)})
    with pytest.raises(DataError, match=r"petastorm Unischema in somewhere cannot be read .*"
                                        r"(posix|os)\.system is not part of a petastorm Unischema"):
        parse_unischema(blob, "somewhere")
    assert not marker.exists()
    metadata = pq.read_schema(os.path.join(FIXTURE, "_common_metadata")).metadata
    assert b"os" not in metadata[UNISCHEMA_KEY].split(b"petastorm")[0]  # the real blob starts with petastorm's class


def test_a_coded_value_of_another_shape_than_the_unischema_names_the_column():
    buf = __import__("io").BytesIO()
    np.save(buf, np.zeros((3, 3), np.float32))
    with pytest.raises(DataError, match=r"column 'mat' holds a value of shape \[3, 3\] but its petastorm Unischema "
                                        r"says \[4, 4\]"):
        Codec("ndarray", "float32", (4, 4)).decode([buf.getvalue()], "mat")
    free = Codec("ndarray", "float32", (None, 3)).decode([buf.getvalue()], "mat")
    assert free.dtype == object and free[0].shape == (3, 3)


def test_a_codec_field_with_a_free_dimension_needs_a_transform_fn():
    from pyspark.sql import types as T

    from sparkring.data import FeatureSpec

    schema = T.StructType([T.StructField("img", T.BinaryType()), T.StructField("y", T.FloatType())])
    codecs = {"img": Codec("png", "uint8", (None, None, 3))}
    with pytest.raises(DataError, match=r"column 'img' \(input 'img'\) holds petastorm arrays whose Unischema leaves "
                                        r"a dimension free: pass transformFn="):
        FeatureSpec.build(schema, inputs=["img"], labels=["y"], codecs=codecs)
    spec = FeatureSpec.build(schema, inputs=["img"], labels=["y"], codecs=codecs, transform=True)
    assert spec.column("img").kind == "coded" and spec.column("img").shape == ()
    fixed = FeatureSpec.build(schema, inputs=["img"], labels=["y"], codecs={"img": Codec("png", "uint8", (8, 8, 3))})
    assert fixed.input_width(fixed.inputs[0]) == 192
