"""Datasets petastorm wrote: their Unischema read from ``_common_metadata`` and their codec
fields (NdarrayCodec, CompressedNdarrayCodec, CompressedImageCodec) decoded — without petastorm.

Written by hand because petastorm cannot be imported beside pyarrow >= 16 (so never beside
Spark 4), while the datasets it wrote outlive it; and because petastorm stores the Unischema
as a pickle, which plain ``pickle.loads`` would let a data file run code with. The unpickler
here builds only inert stand-ins of petastorm's schema and codec classes and refuses any
other global. Images decode with Pillow (lossless PNG gives exactly what petastorm's OpenCV
gives; JPEG may differ by up to two levels where the two libjpeg builds round differently).

>>> codecs = petastorm_codecs(spark.read.parquet("file:///data/mnist_petastorm"))  # doctest: +SKIP
>>> codecs["image"]  # doctest: +SKIP
Codec(kind='png', dtype='uint8', shape=(28, 28))
"""
from __future__ import annotations

import io
import logging
import pickle
import posixpath
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from ..errors import DataError

logger = logging.getLogger(__name__)

UNISCHEMA_KEY = b"dataset-toolkit.unischema.v1"
METADATA_NAME = "_common_metadata"
NDARRAY, COMPRESSED_NDARRAY, PNG, JPEG = "ndarray", "compressed_ndarray", "png", "jpeg"
CODECS = (NDARRAY, COMPRESSED_NDARRAY, PNG, JPEG)


@dataclass(frozen=True)
class Codec:
    """How one petastorm field is encoded, and the dtype and shape it decodes to
    (None for a dimension the Unischema leaves free).

    >>> Codec(PNG, "uint8", (28, 28)).decode([png_bytes]).shape  # doctest: +SKIP
    (1, 28, 28)
    """

    kind: str
    dtype: str
    shape: Tuple[Optional[int], ...]

    @property
    def fixed(self) -> bool:
        """Whether every dimension of the shape is known."""
        return all(d is not None for d in self.shape)

    def decode_one(self, value, column: str) -> np.ndarray:
        """One stored value as the array petastorm's codec would decode it."""
        try:
            if self.kind in (NDARRAY, COMPRESSED_NDARRAY):
                loaded = np.load(io.BytesIO(value), allow_pickle=False)
                arr = loaded["arr"] if self.kind == COMPRESSED_NDARRAY else loaded
            else:
                from PIL import Image

                with Image.open(io.BytesIO(value)) as image:
                    arr = np.asarray(image)
        except ImportError as exc:
            raise DataError(f"column {column!r} holds {self.kind.upper()} images (petastorm CompressedImageCodec): "
                            "decoding them needs Pillow (pip install pillow)") from exc
        except Exception as exc:  # noqa: BLE001 - any decoder failure is bad data in this column
            raise DataError(f"column {column!r} holds a value that is not a {self.kind} of the petastorm "
                            f"Unischema ({type(exc).__name__}: {exc})") from exc
        arr = arr.astype(np.dtype(self.dtype), copy=False)
        fits = len(arr.shape) == len(self.shape) and all(d is None or d == a for d, a in zip(self.shape, arr.shape))
        if self.shape and not fits:
            raise DataError(f"column {column!r} holds a value of shape {list(arr.shape)} but its petastorm "
                            f"Unischema says {list(self.shape)}")
        return arr

    def decode(self, values: Sequence[Any], column: str) -> np.ndarray:
        """Stored values (bytes) as one array of rows of ``shape``, or, where the shape is not
        fixed (the Unischema leaves a dimension free), an object array of arrays."""
        if self.shape and self.fixed:
            out = np.empty((len(values),) + tuple(self.shape), dtype=np.dtype(self.dtype))  # type: ignore[arg-type, type-var]
            for i, value in enumerate(values):
                if value is None:
                    raise DataError(f"column {column!r} has a null value in row {i}: fill or drop it")
                out[i] = self.decode_one(value, column)
            return out
        out = np.empty(len(values), dtype=object)
        for i, value in enumerate(values):
            out[i] = None if value is None else self.decode_one(value, column)
        return out


class _Inert:
    """Stands in for a petastorm or pyspark class while unpickling: keeps arguments and state."""

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj.args = args
        return obj

    def __setstate__(self, state):
        if isinstance(state, dict):
            self.__dict__.update(state)


class _Field(tuple):
    """Stands in for petastorm's UnischemaField (name, numpy_dtype, shape, codec, nullable)."""

    def __new__(cls, *args):
        return tuple.__new__(cls, args)


_CODEC_CLASSES = {"ScalarCodec", "NdarrayCodec", "CompressedNdarrayCodec", "CompressedImageCodec"}
_BUILTINS = {"str": str, "bytes": bytes, "int": int, "float": float, "bool": bool}


class _UnischemaUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "petastorm.unischema" and name == "UnischemaField":
            return _Field
        if module == "petastorm.unischema" and name == "Unischema":
            return type("Unischema", (_Inert,), {})
        if module == "petastorm.codecs" and name in _CODEC_CLASSES:
            return type(name, (_Inert,), {})
        if module == "pyspark.sql.types" and name.endswith("Type"):
            return type(name, (_Inert,), {})
        if module == "collections" and name == "OrderedDict":
            from collections import OrderedDict

            return OrderedDict
        if module == "numpy" and name == "dtype":
            return np.dtype
        numpy_type = getattr(np, name, None) if module == "numpy" else None
        if isinstance(numpy_type, type) and issubclass(numpy_type, np.generic):
            return getattr(np, name)
        if module == "decimal" and name == "Decimal":
            from decimal import Decimal

            return Decimal
        if module == "builtins" and name in _BUILTINS:
            return _BUILTINS[name]
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a petastorm Unischema")


def parse_unischema(blob: bytes, where: str) -> Dict[str, Codec]:
    """The codec fields of a pickled Unischema: field name -> Codec (scalar fields are left out:
    they are stored as plain Parquet columns)."""
    try:
        schema = _UnischemaUnpickler(io.BytesIO(blob)).load()
        fields = schema.__dict__["_fields"]
    except Exception as exc:  # noqa: BLE001 - anything unexpected in the blob is an unreadable schema
        raise DataError(f"the petastorm Unischema in {where} cannot be read ({type(exc).__name__}: {exc}); "
                        "rewrite the dataset, or read its columns as plain binary with a transformFn") from exc
    codecs: Dict[str, Codec] = {}
    for name, field in fields.items():
        _, numpy_dtype, shape, codec = tuple(field)[:4]
        kind = type(codec).__name__ if codec is not None else None
        if kind == "NdarrayCodec":
            codec_kind = NDARRAY
        elif kind == "CompressedNdarrayCodec":
            codec_kind = COMPRESSED_NDARRAY
        elif kind == "CompressedImageCodec":
            image = str(codec.__dict__.get("_image_codec", ".png")).lstrip(".").lower()
            codec_kind = JPEG if image in ("jpg", "jpeg") else PNG if image == "png" else image
            if codec_kind not in CODECS:
                raise DataError(f"field {name!r} of the petastorm Unischema in {where} holds {image} images; "
                                "sparkring decodes png and jpeg: read it as binary with a transformFn")
        else:
            continue
        codecs[str(name)] = Codec(codec_kind, np.dtype(numpy_dtype).name,
                                  tuple(None if d is None else int(d) for d in shape))
    return codecs


def read_unischema(url: str, storage_options: Optional[Dict[str, Any]] = None) -> Dict[str, Codec]:
    """The codec fields of the Unischema in the ``_common_metadata`` file at ``url`` ({} when
    that file holds none: a Parquet dataset petastorm did not write)."""
    import pyarrow.parquet as pq

    from .store import open_filesystem

    fs, path = open_filesystem(url, storage_options)
    with fs.open_input_file(path) as f:
        metadata = pq.read_schema(f).metadata or {}
    blob = metadata.get(UNISCHEMA_KEY)
    return parse_unischema(blob, url) if blob else {}


def petastorm_codecs(df, storage_options: Optional[Dict[str, Any]] = None) -> Dict[str, Codec]:
    """Codecs of ``df``'s binary columns that a petastorm dataset it reads encoded: column -> Codec.

    Looks only when ``df`` has a binary column, and only at the ``_common_metadata`` files
    among ``df.inputFiles()`` (Spark lists them with a dataset's data files); no Spark job.

    >>> petastorm_codecs(spark.read.parquet(url))  # doctest: +SKIP
    {'mat': Codec(kind='ndarray', dtype='float32', shape=(4, 4)), 'img': Codec(kind='png', ...)}
    """
    from pyspark.sql import types as T

    binary = {f.name for f in df.schema.fields if isinstance(f.dataType, T.BinaryType)}
    if not binary:
        return {}
    try:
        files = df.inputFiles()
    except Exception as exc:  # noqa: BLE001 - a plan without files (e.g. createDataFrame) on some versions
        logger.debug("no input files to look for a petastorm Unischema in: %s", exc)
        return {}
    codecs: Dict[str, Codec] = {}
    for url in sorted({f for f in files if posixpath.basename(f) == METADATA_NAME}):
        found = read_unischema(url, storage_options)
        for name, codec in found.items():
            if name in binary:
                if name in codecs and codecs[name] != codec:
                    raise DataError(f"column {name!r} is encoded differently by two petastorm datasets this "
                                    f"DataFrame reads ({codecs[name]} and {codec})")
                codecs[name] = codec
        if found:
            logger.info("petastorm Unischema in %s: decoding %s", url,
                        {n: c.kind for n, c in found.items() if n in binary})
    return codecs
