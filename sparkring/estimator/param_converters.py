"""How each Param's value is converted and checked as it is set (pyspark.ml's typeConverter of the Param table)."""
from __future__ import annotations

from typing import Any, List, Union

from pyspark.ml.param import TypeConverters


def identity(value: Any) -> Any:
    """A Python object Param's value, as it is."""
    return value


def names_converter(what: str):
    """A converter to one column name or a non-empty list of them; ``what`` says what the list means."""
    def convert(value: Any) -> Union[str, List[str]]:
        if isinstance(value, str):
            return value
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
            return list(value)
        raise TypeError(f"{what}: give a column name or a non-empty list of names, got {value!r}")
    return convert


to_columns = names_converter("featuresCol")
to_names = names_converter("labelCol/predictionCol (one name per model head)")


def to_model_inputs(value: Any):
    """modelInputs: a list of columns (or column lists), or a dict input name -> column(s)."""
    if value is None or isinstance(value, dict):
        return value
    if isinstance(value, (list, tuple)):
        return [v if isinstance(v, str) else list(v) for v in value]
    raise TypeError(f"modelInputs must be a list of columns (or column lists) or a dict name -> column(s), "
                    f"got {value!r}")


def to_input_shapes(value: Any):
    """inputShapes: one shape, a list of them, or a dict input name -> shape."""
    if value is None or isinstance(value, dict):
        return None if value is None else {k: list(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return list(value)
    raise TypeError(f"inputShapes must be a shape (list of ints) or a dict input name -> shape, got {value!r}")


def to_loss_weights(value: Any):
    """lossWeights: one number per label."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return [TypeConverters.toFloat(v) for v in value]
    raise TypeError(f"lossWeights must be a list of numbers, one per label, got {value!r}")


def to_validation(value: Any) -> Union[None, float, str]:
    """validation: a fraction in (0, 1) or a boolean column's name."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        raise TypeError("validation must be a fraction in (0, 1) or a boolean column name, not a bool")
    return TypeConverters.toFloat(value)


def to_optional_int(value: Any):
    """An int, or None."""
    return None if value is None else TypeConverters.toInt(value)


def to_optional_float(value: Any):
    """A float, or None."""
    return None if value is None else TypeConverters.toFloat(value)


def to_optional_names(value: Any):
    """fsdpWrap, pipelineSplit: a list of names, or None."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise TypeError(f"fsdpWrap and pipelineSplit take a list of names, e.g. ['TransformerEncoderLayer'] or "
                    f"['layers.2'], got {value!r}")


def to_compile(value: Any):
    """compile: True/False or a dict of torch.compile options."""
    if isinstance(value, bool) or isinstance(value, dict):
        return value
    raise TypeError(f"compile must be True/False or a dict of torch.compile options, got {value!r}")


def to_resource_profile(value: Any):
    """resourceProfile: 'auto', 'off' or a pyspark ResourceProfile."""
    if value in ("auto", "off") or (not isinstance(value, str) and hasattr(value, "taskResources")):
        return value
    raise TypeError(f"resourceProfile must be 'auto', 'off' or a pyspark.resource.ResourceProfile, got {value!r}")


def to_optional_string(value: Any):
    """A string, or None."""
    return None if value is None else TypeConverters.toString(value)
