"""A fit on a text column: its checks before any Spark job, the Params of the fit on the token
columns it becomes, and the language-model figures (tokens/s, perplexity, MFU) in its history."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
from pyspark.sql import types as T

from ..data.text import Encoder, Masking, TextLayout, TokenCounts
from ..errors import ConfigurationError, DataError
from ..trainer.losses import CAUSAL_LM, MASKED_LM
from .config import TASKS, EstimatorConfig

CAUSAL, CLASSIFY, MASKED = TASKS


def _check_head(task: str, shape: torch.nn.Module) -> None:
    """A Hugging Face model's head must do the task: a classifier cannot be trained as a language
    model, nor a language model as a classifier."""
    base = shape.get_base_model() if hasattr(shape, "get_base_model") else shape  # type: ignore[operator]
    name = type(base).__name__
    if task == "causal-lm" and "ForSequenceClassification" in name:
        raise ConfigurationError(f"task='causal-lm' needs a language-model head; {name} classifies: use "
                                 "task='sequence-classification', or an ...ForCausalLM model")
    if task == CLASSIFY and ("ForCausalLM" in name or "LMHead" in name or "ForMaskedLM" in name):
        raise ConfigurationError(f"task='sequence-classification' needs a classification head; {name} predicts "
                                 "tokens: use an ...ForSequenceClassification model, or task='causal-lm'")
    if task == MASKED and "ForMaskedLM" not in name:
        raise ConfigurationError(f"task='masked-lm' needs an encoder with a masked-LM head; {name} is not one: use "
                                 "an ...ForMaskedLM model (BERT, RoBERTa, ...), or task='causal-lm' for a decoder")
    if task == CAUSAL and "ForMaskedLM" in name:
        raise ConfigurationError(f"task='causal-lm' needs a decoder; {name} is an encoder that fills in masked tokens: "
                                 "use task='masked-lm', or an ...ForCausalLM model")


def text_layout(config: EstimatorConfig, df, shape: torch.nn.Module) -> TextLayout:
    """textCol's checks (refused before any Spark job, naming the Param and the fix) and how its
    documents become rows."""
    column = config.text_col
    assert column is not None, "a fit on a text column"
    fields = {f.name: f.dataType for f in df.schema.fields}
    if column not in fields:
        raise ConfigurationError(f"textCol={column!r} is not a column of the DataFrame (it has {sorted(fields)})")
    if not isinstance(fields[column], T.StringType):
        raise ConfigurationError(f"textCol={column!r} is {fields[column].simpleString()}, not a string column: "
                                 "cast it, or train on numeric columns with featuresCol")
    task = config.task
    if task not in TASKS:
        raise ConfigurationError(f"textCol needs task= one of {', '.join(map(repr, TASKS))} (what to train on the "
                                 f"text), got {task!r}")
    _check_head(task, shape)
    # a classifier reads one document per row (its label beside it), and an encoder's attention looks
    # both ways (no restart at a document's start): only a causal LM packs
    pack = config.pack_sequences and task == CAUSAL
    validation = config.validation
    keep = tuple(c for c in (config.label_columns if task == CLASSIFY else [])
                 + ([validation] if isinstance(validation, str) else []))
    if isinstance(validation, str) and pack:
        raise ConfigurationError("validation names a column, but packSequences=True mixes documents in one row: "
                                 "give validation as a fraction, or packSequences=False")
    missing = [c for c in keep if c not in fields]
    if missing:
        raise ConfigurationError(f"task={task!r} reads column(s) {missing}, which the DataFrame lacks (it has "
                                 f"{sorted(fields)}): set labelCol")
    if config.sample_weight_col is not None and task != CLASSIFY:
        raise ConfigurationError(f"sampleWeightCol does not apply to task={task!r}: every real token counts once")
    try:
        encoder = Encoder(config.tokenizer)
        eos, pad = encoder.special_ids()
        masking = (Masking(encoder.mask_id(), encoder.vocab_size(), seed=config.seed or 0)
                   if task == MASKED else None)
    except DataError as exc:
        raise ConfigurationError(str(exc)) from None
    return TextLayout(column=column, sequence_length=config.sequence_length, pack=pack, eos_id=eos,
                      pad_id=pad, keep=keep, masking=masking)


def token_config(config: EstimatorConfig, layout: TextLayout) -> EstimatorConfig:
    """The configuration of the fit on the token columns a text fit becomes (with LoRA, its model is
    the adapted one every rank builds). Packed rows go without an attention mask: a Hugging Face model
    then reads the restarting position ids as documents, each attending only within itself."""
    inputs = {"input_ids": "input_ids", "position_ids": "position_ids"}
    if not layout.pack:
        inputs["attention_mask"] = "attention_mask"
    tokens = dataclasses.replace(config, text_col=None, features_col="input_ids", label_col="labels", loss=CAUSAL_LM,
                                 model_inputs=inputs)
    with_mask = {"input_ids": "input_ids", "attention_mask": "attention_mask"}
    if config.task == MASKED:
        tokens = dataclasses.replace(tokens, loss=MASKED_LM, model_inputs=with_mask)
    if config.task == CLASSIFY:  # labelCol as it is, a class per document
        tokens = dataclasses.replace(tokens, label_col=config.label_col, loss="cross_entropy", model_inputs=with_mask)
    if config.lora is not None:
        tokens = dataclasses.replace(tokens, model=WithLora(config.model, config.lora), lora=None)
    return tokens


class WithLora:
    """A model factory that adds LoRA adapters (peft) to the user's model or factory: every rank
    builds the same adapted module (the trainer seeds it), of which only the adapters train.

    >>> WithLora(lambda: llama, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))()  # doctest: +SKIP
    PeftModelForCausalLM(...)
    """

    def __init__(self, model: Any, config: Any):
        self.model, self.config = model, config

    def __call__(self) -> torch.nn.Module:
        """The base model with the LoRA adapters attached (peft's get_peft_model)."""
        import copy

        from peft import get_peft_model

        base = copy.deepcopy(self.model) if isinstance(self.model, torch.nn.Module) else self.model()
        return get_peft_model(base, copy.deepcopy(self.config))


def check_lora(config: EstimatorConfig) -> None:
    """LoRA needs peft, and applies to textCol fits."""
    if config.lora is None:
        return
    if config.text_col is None:
        raise ConfigurationError("lora applies to a fit on a text column (textCol, task): set them, or drop lora")
    try:
        import peft  # noqa: F401
    except ImportError:
        raise ConfigurationError("lora needs peft: pip install 'sparkring[text]'") from None


def merged(model: torch.nn.Module) -> torch.nn.Module:
    """A LoRA-adapted model with its adapters folded into the base weights (a copy); others as they are."""
    import copy

    if not hasattr(model, "merge_and_unload"):
        return model
    return copy.deepcopy(model).merge_and_unload()  # type: ignore[operator]


@dataclass(frozen=True)
class TokenFigures:
    """How a text fit's row figures become its token figures: ``per_row`` real tokens a row on
    average, the model's ``params`` (6 x params FLOPs a token, forward and backward) against one
    rank's ``peak_flops``, and whether the loss is a language model's (its perplexity).

    >>> TokenFigures(per_row=8.0, params=10, peak_flops=1e4).mfu(80.0)
    0.48
    """

    per_row: float
    params: int = 0
    peak_flops: Optional[float] = None
    language_model: bool = True

    def rate(self, samples_per_second: float) -> float:
        """Tokens per second at ``samples_per_second``."""
        return samples_per_second * self.per_row

    def mfu(self, tokens_per_second: float) -> Optional[float]:
        """Model FLOPs utilization at ``tokens_per_second`` (6 N tokens/s over the peak); None without a peak."""
        return 6 * self.params * tokens_per_second / self.peak_flops if self.peak_flops else None


def with_figures(history: List[Dict[str, Any]], counts: TokenCounts, figures: TokenFigures,
                 model_parallel: int = 1) -> List[Dict[str, Any]]:
    """Each epoch's tokens/s (per rank, and total over the data-parallel replicas: a tensor- or
    pipeline-parallel group of ``model_parallel`` ranks reads one replica's rows), perplexity (and
    val_perplexity: a language model's), the tokens kept and cut off, and the MFU (with a peak).

    >>> figures = TokenFigures(per_row=8.0, params=10, peak_flops=1e4)
    >>> with_figures([{"loss": 0.0, "samples_per_second": 10.0, "num_proc": 2}], TokenCounts(4, 4, 32, 1),
    ...              figures)  # doctest: +NORMALIZE_WHITESPACE
    [{'loss': 0.0, 'samples_per_second': 10.0, 'num_proc': 2, 'tokens_per_second': 80.0,
      'tokens_per_second_total': 160.0, 'perplexity': 1.0, 'tokens': 32, 'tokens_cut': 1, 'mfu': 0.48}]
    """
    out = []
    for epoch in history:
        row = dict(epoch)
        rate = figures.rate(epoch.get("samples_per_second", 0.0))
        row["tokens_per_second"] = rate
        row["tokens_per_second_total"] = rate * epoch.get("num_proc", 1) / model_parallel
        if figures.language_model:
            row["perplexity"] = math.exp(min(epoch["loss"], 700.0))
            if "val_loss" in epoch:
                row["val_perplexity"] = math.exp(min(epoch["val_loss"], 700.0))
        row["tokens"], row["tokens_cut"] = counts.kept, counts.cut
        mfu = figures.mfu(rate)
        if mfu is not None:
            row["mfu"] = mfu
        out.append(row)
    return out
