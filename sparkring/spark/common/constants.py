"""Horovod's ``horovod.spark.common.constants``: the names of a column's intermediate format."""

ARRAY = "array"
CUSTOM_SPARSE = "custom_sparse_format"
NOCHANGE = "nochange"
MIXED_SPARSE_DENSE_VECTOR = "mixed_sparse_dense_vector"
SPARSE_VECTOR = "sparse_vector"
DENSE_VECTOR = "dense_vector"
