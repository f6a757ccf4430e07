"""A fit on a text column: its checks before any Spark job, the Params of the fit on the token
columns it becomes, and the language-model figures (tokens/s, perplexity, MFU) in its history."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import torch
from pyspark.sql import types as T

from ..data.text import Encoder, TextLayout, TokenCounts, mean_tokens
from ..errors import ConfigurationError, DataError
from ..trainer.losses import CAUSAL_LM

TASKS = ("causal-lm",)


def text_layout(est, df) -> TextLayout:
    """textCol's checks (refused before any Spark job, naming the Param and the fix) and how its
    documents become rows."""
    column = est.getOrDefault("textCol")
    fields = {f.name: f.dataType for f in df.schema.fields}
    if column not in fields:
        raise ConfigurationError(f"textCol={column!r} is not a column of the DataFrame (it has {sorted(fields)})")
    if not isinstance(fields[column], T.StringType):
        raise ConfigurationError(f"textCol={column!r} is {fields[column].simpleString()}, not a string column: "
                                 "cast it, or train on numeric columns with featuresCol")
    task = est.getOrDefault("task")
    if task not in TASKS:
        raise ConfigurationError(f"textCol needs task= one of {', '.join(map(repr, TASKS))} (what to train on the "
                                 f"text), got {task!r}")
    if isinstance(est.getOrDefault("validation"), str) and est.getOrDefault("packSequences"):
        raise ConfigurationError("validation names a column, but packSequences=True mixes documents in one row: "
                                 "give validation as a fraction, or packSequences=False")
    if est.getOrDefault("sampleWeightCol") is not None:
        raise ConfigurationError("sampleWeightCol does not apply to task='causal-lm': every real token counts once")
    try:
        encoder = Encoder(est.getOrDefault("tokenizer"))
        eos, pad = encoder.special_ids()
    except DataError as exc:
        raise ConfigurationError(str(exc)) from None
    return TextLayout(column=column, sequence_length=est.getOrDefault("sequenceLength"),
                      pack=est.getOrDefault("packSequences"), eos_id=eos, pad_id=pad)


def token_params(layout: TextLayout) -> Dict[str, Any]:
    """The Params of the fit on the token columns a causal-lm text fit becomes."""
    return {"textCol": None, "featuresCol": "input_ids", "labelCol": "labels", "loss": CAUSAL_LM,
            "modelInputs": {"input_ids": "input_ids", "position_ids": "position_ids",
                            "attention_mask": "attention_mask"}}


def parameters(model: Any) -> int:
    if isinstance(model, torch.nn.Module):
        return sum(p.numel() for p in model.parameters())
    with torch.device("meta"):
        return sum(p.numel() for p in model().parameters())


def with_figures(history: List[Dict[str, Any]], counts: TokenCounts, params: int,
                 peak_flops: Optional[float], model_parallel: int = 1) -> List[Dict[str, Any]]:
    """Each epoch's tokens/s (per rank, and total over the data-parallel replicas: a tensor- or
    pipeline-parallel group of ``model_parallel`` ranks reads one replica's rows), perplexity (and
    val_perplexity), the tokens kept and cut off, and the MFU against ``peak_flops`` (one rank's).

    >>> with_figures([{"loss": 0.0, "samples_per_second": 10.0, "num_proc": 2}], TokenCounts(4, 4, 32, 1), 10, 1e4)
    [{'loss': 0.0, 'samples_per_second': 10.0, 'num_proc': 2, 'tokens_per_second': 80.0, 'tokens_per_second_total': 160.0, 'perplexity': 1.0, 'tokens': 32, 'tokens_cut': 1, 'mfu': 0.48}]
    """
    per_row = mean_tokens(counts)
    out = []
    for epoch in history:
        figures = dict(epoch)
        rate = epoch.get("samples_per_second", 0.0) * per_row
        figures["tokens_per_second"] = rate
        figures["tokens_per_second_total"] = rate * epoch.get("num_proc", 1) / model_parallel
        figures["perplexity"] = math.exp(min(epoch["loss"], 700.0))
        if "val_loss" in epoch:
            figures["val_perplexity"] = math.exp(min(epoch["val_loss"], 700.0))
        figures["tokens"], figures["tokens_cut"] = counts.kept, counts.cut
        if peak_flops:
            figures["mfu"] = 6 * params * rate / peak_flops
        out.append(figures)
    return out
