"""transform() of a model fitted on a text column, one batch of documents at a time on the
executors: generate (greedy or sampled continuations, left padding, the KV cache; a Llama's greedy
continuations by greedy_decoding), embed (the last hidden state mean-pooled over real tokens),
score (each row's loss and perplexity), or a sequence classifier's predict (each document's most
likely class)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pandas as pd
import torch

from ..data.text import Encoder
from .greedy_decoding import GreedyLlama

MODES = ("predict", "generate", "embed", "score")
DEFAULT_GENERATION = {"max_new_tokens": 16, "do_sample": False}


@dataclass(frozen=True)
class TextInference:
    """What a text transform runs on each batch of documents (the recipe, not the weights).

    >>> TextInference(Encoder(tok), mode="generate", eos_id=1, pad_id=0).spark_type  # doctest: +SKIP
    'string'
    """

    encoder: Encoder
    mode: str
    eos_id: int
    pad_id: int
    max_length: int = 512
    generation: Dict[str, Any] = field(default_factory=dict)

    @property
    def spark_type(self) -> str:
        return {"generate": "string", "embed": "array<double>", "score": "struct<loss:double,perplexity:double>",
                "predict": "double"}[self.mode]

    def run(self, model: torch.nn.Module, device: torch.device, texts: Sequence[str],
            batch_size: Optional[int] = None) -> List[Any]:
        """One value per document, as ``spark_type`` says, ``batch_size`` documents a forward pass
        (all at once by default); generation settles once which decoding loop runs them."""
        size = max(1, batch_size or len(texts))
        settings = {**DEFAULT_GENERATION, **self.generation}
        greedy = GreedyLlama.for_model(model, settings) if self.mode == "generate" else None
        return [value for start in range(0, len(texts), size)
                for value in self._run_batch(model, device, [str(t) for t in texts[start:start + size]], greedy)]

    def _run_batch(self, model: torch.nn.Module, device: torch.device, texts: List[str],
                   greedy: Optional[GreedyLlama]) -> List[Any]:
        if self.mode == "generate":
            return self._generate(model, device, texts, greedy)
        with torch.no_grad():
            # documents were closed by end of sequence in training: scoring and classifying see them so
            ids, mask = self._batch(texts, left=False, device=device, close=self.mode in ("score", "predict"))
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

    def _batch(self, texts: List[str], left: bool, device: torch.device,
               close: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
        """Token ids padded to the longest document (on the left for generation: the new tokens
        follow every prompt directly), and the attention mask."""
        docs = [ids[-self.max_length:] for ids in self.encoder.encode(texts)]
        if close:
            docs = [(ids + [self.eos_id])[-self.max_length:] for ids in docs]
        width = max(1, max(len(ids) for ids in docs))
        ids = torch.full((len(docs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(docs), width), dtype=torch.long)
        for i, doc in enumerate(docs):
            span = slice(width - len(doc), width) if left else slice(0, len(doc))
            ids[i, span] = torch.tensor(doc, dtype=torch.long)
            mask[i, span] = 1
        return ids.to(device), mask.to(device)

    def _generate(self, model: torch.nn.Module, device: torch.device, texts: List[str],
                  greedy: Optional[GreedyLlama]) -> List[str]:
        ids, mask = self._batch(texts, left=True, device=device)
        settings = {**DEFAULT_GENERATION, **self.generation}
        if greedy is not None and bool(mask.any(-1).all()):  # an empty prompt takes generate()'s positions
            new = greedy.generate(ids, mask, settings["max_new_tokens"], self.eos_id, self.pad_id)
        else:
            with torch.no_grad():
                new = model.generate(input_ids=ids, attention_mask=mask,  # type: ignore[operator]
                                     pad_token_id=self.pad_id, eos_token_id=self.eos_id, use_cache=True,
                                     **settings)[:, ids.shape[1]:]
        return [self.encoder.decode([t for t in row.tolist() if t not in (self.pad_id, self.eos_id)])
                for row in new.cpu()]


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder without its head, which gives the last hidden state: a Hugging Face model's
    base model (under a LoRA wrapper, the adapted model's)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # type: ignore[operator]
    return getattr(inner, "base_model", inner)


@dataclass(frozen=True)
class TextPredictor:
    """A text model's pyfunc recipe (MLflow): a pandas column of documents in, the prediction
    column transform() writes out.

    >>> TextPredictor(recipe, "text", "prediction", 32).predict_pandas(net, torch.device("cpu"), frame)  # doctest: +SKIP
    """

    recipe: TextInference
    column: str
    prediction: str
    batch_size: int

    def predict_pandas(self, model: torch.nn.Module, device: torch.device, frame: pd.DataFrame) -> pd.DataFrame:
        texts = frame[self.column] if self.column in frame.columns else frame.iloc[:, 0]
        values = self.recipe.run(model, device, list(texts), self.batch_size)
        return pd.DataFrame({self.prediction: values}, index=frame.index)
