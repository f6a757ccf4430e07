"""transform() of a model fitted on a text column, one batch of documents at a time on the
executors: generate (greedy or sampled continuations, left padding, the KV cache; a Llama's greedy
continuations by greedy_decoding), embed (the last hidden state mean-pooled over real tokens),
score (each row's loss and perplexity), or a sequence classifier's predict (each document's most
likely class)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple, get_args

import pandas as pd
import torch

from ..data.text import Encoder
from .greedy_decoding import GreedyLlama

InferenceMode = Literal["predict", "generate", "embed", "score"]
MODES: Tuple[InferenceMode, ...] = get_args(InferenceMode)
DEFAULT_GENERATION = {"max_new_tokens": 16, "do_sample": False}


@dataclass(frozen=True)
class TextInference:
    """What a text transform runs on each batch of documents (the recipe; the model and its
    tokenizer, which the executors keep between tasks, come to ``run``).

    >>> recipe = TextInference(mode="generate", eos_id=1, pad_id=0)
    >>> recipe.spark_type
    'string'
    >>> recipe.run(model, Encoder(tok), torch.device("cpu"), ["the cat"])  # doctest: +SKIP
    [' sat on the mat']
    """

    mode: str
    eos_id: int
    pad_id: int
    max_length: int = 512
    generation: Dict[str, Any] = field(default_factory=dict)

    @property
    def spark_type(self) -> str:
        """The output column's Spark SQL type for this mode."""
        return {"generate": "string", "embed": "array<double>", "score": "struct<loss:double,perplexity:double>",
                "predict": "double"}[self.mode]

    def run(self, model: torch.nn.Module, encoder: Encoder, device: torch.device, texts: Sequence[str],
            batch_size: Optional[int] = None) -> List[Any]:
        """One value per document, as ``spark_type`` says, ``batch_size`` documents a forward pass
        (all at once by default). Documents of similar length share a batch, so a batch pads to
        little more than its own documents, and each value goes back to its document's place;
        generation settles once which decoding loop runs them."""
        docs = self._tokens(encoder, [str(t) for t in texts])
        by_length = sorted(range(len(docs)), key=lambda i: len(docs[i]))
        size = max(1, batch_size or len(docs))
        settings = {**DEFAULT_GENERATION, **self.generation}
        greedy = GreedyLlama.for_model(model, settings) if self.mode == "generate" else None
        values: List[Any] = [None] * len(docs)
        for start in range(0, len(docs), size):
            rows = by_length[start:start + size]
            batch = [docs[i] for i in rows]
            for row, value in zip(rows, self._run_batch(model, encoder, device, batch, greedy)):
                values[row] = value
        return values

    def _tokens(self, encoder: Encoder, texts: List[str]) -> List[List[int]]:
        """Each document's token ids, its last ``max_length``: closed by end of sequence for
        scoring and classifying, as documents were in training."""
        docs = encoder.encode(texts)
        if self.mode in ("score", "predict"):
            docs = [ids + [self.eos_id] for ids in docs]
        return [ids[-self.max_length:] for ids in docs]

    def _run_batch(self, model: torch.nn.Module, encoder: Encoder, device: torch.device, docs: List[List[int]],
                   greedy: Optional[GreedyLlama]) -> List[Any]:
        if self.mode == "generate":
            return self._generate(model, encoder, device, docs, greedy)
        with torch.no_grad():
            ids, mask = _padded(docs, left=False, pad_id=self.pad_id, device=device)
            if self.mode == "predict":  # a classifier: the most likely class of each document
                return [float(c) for c in model(input_ids=ids, attention_mask=mask).logits.argmax(-1).cpu()]
            if self.mode == "embed":
                hidden = _decoder(model)(input_ids=ids, attention_mask=mask).last_hidden_state
                weights = mask.unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * weights).sum(1) / weights.sum(1).clamp_min(1.0)
                return [row.tolist() for row in pooled.double().cpu()]
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
            per_token = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:].long(),
                                                          reduction="none")
            real = mask[:, 1:].to(per_token.dtype)
            losses = (per_token * real).sum(1) / real.sum(1).clamp_min(1.0)
            return [{"loss": float(v), "perplexity": math.exp(min(float(v), 700.0))} for v in losses.cpu()]

    def _generate(self, model: torch.nn.Module, encoder: Encoder, device: torch.device, docs: List[List[int]],
                  greedy: Optional[GreedyLlama]) -> List[str]:
        ids, mask = _padded(docs, left=True, pad_id=self.pad_id, device=device)
        settings = {**DEFAULT_GENERATION, **self.generation}
        if greedy is not None and bool(mask.any(-1).all()):  # an empty prompt takes generate()'s positions
            new = greedy.generate(ids, mask, settings["max_new_tokens"], self.eos_id, self.pad_id)
        else:
            with torch.no_grad():
                new = model.generate(input_ids=ids, attention_mask=mask,  # type: ignore[operator]
                                     pad_token_id=self.pad_id, eos_token_id=self.eos_id, use_cache=True,
                                     **settings)[:, ids.shape[1]:]
        return [encoder.decode([t for t in row.tolist() if t not in (self.pad_id, self.eos_id)])
                for row in new.cpu()]


def _padded(docs: List[List[int]], left: bool, pad_id: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token ids padded to the longest document (on the left for generation: the new tokens
    follow every prompt directly), and the attention mask."""
    width = max(1, max(len(ids) for ids in docs))
    ids = torch.full((len(docs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(docs), width), dtype=torch.long)
    for i, doc in enumerate(docs):
        span = slice(width - len(doc), width) if left else slice(0, len(doc))
        ids[i, span] = torch.tensor(doc, dtype=torch.long)
        mask[i, span] = 1
    return ids.to(device), mask.to(device)


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder without its head, which gives the last hidden state: a Hugging Face model's
    base model (under a LoRA wrapper, the adapted model's)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # type: ignore[operator]
    return getattr(inner, "base_model", inner)


@dataclass(frozen=True)
class TextPredictor:
    """A text model's pyfunc recipe (MLflow): a pandas column of documents in, the prediction
    column transform() writes out.

    >>> predictor = TextPredictor(recipe, Encoder(tok), "text", "prediction", 32)  # doctest: +SKIP
    >>> predictor.predict_pandas(net, torch.device("cpu"), frame)  # doctest: +SKIP
    """

    recipe: TextInference
    encoder: Encoder
    column: str
    prediction: str
    batch_size: int

    def predict_pandas(self, model: torch.nn.Module, device: torch.device, frame: pd.DataFrame) -> pd.DataFrame:
        """The prediction column for the texts of ``frame``."""
        texts = frame[self.column] if self.column in frame.columns else frame.iloc[:, 0]
        values = self.recipe.run(model, self.encoder, device, list(texts), self.batch_size)
        return pd.DataFrame({self.prediction: values}, index=frame.index)
