"""Text columns tokenized on the executors: each document's token ids (int32) packed into, or
padded to, rows of ``sequence_length`` with position ids, an attention mask and next-token labels,
and the counts of tokens kept and cut off (nothing is dropped silently).

Packing concatenates a partition's documents, each closed by the end-of-sequence token, and cuts
them into rows; the position ids restart at every document (a Hugging Face model given them without
an attention mask restarts its attention there too). Without packing each document is one row, cut
to the length and padded. For a masked language model, a seeded 15% of each row's real tokens are
hidden (BERT's recipe: 80% the mask token, 10% a random token, 10% as they were) and are its labels.
The tokenizer is a ``tokenizers.Tokenizer``, a transformers tokenizer, or a local directory
(``AutoTokenizer.from_pretrained(path, local_files_only=True)``: never a download)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Hashable, Iterator, List, Optional, Tuple

from ..errors import DataError
from . import reuse as reuse_cache

TOKEN_COLUMNS = ("input_ids", "position_ids", "attention_mask", "labels")
IGNORED = -100  # a label that counts for nothing (padding)
_END_NAMES = ("</s>", "<|endoftext|>", "<eos>", "<|eos|>", "[EOS]", "[SEP]")
_PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>")
_MASK_NAMES = ("[MASK]", "<mask>", "<|mask|>")
SCHEMA = ("input_ids array<int>, position_ids array<int>, attention_mask array<int>, labels array<int>, "
          "tokens int, cut int, documents int")


class Encoder:
    """The user's tokenizer as the executors use it: picklable, loaded where it runs.

    >>> Encoder(tokenizers.Tokenizer.from_file("tok.json")).encode(["a b"])  # doctest: +SKIP
    [[17, 18]]
    """

    def __init__(self, tokenizer: Any):
        if tokenizer is None:
            raise DataError("textCol needs a tokenizer: a tokenizers.Tokenizer, a transformers tokenizer, or the "
                            "local directory of one")
        self.source = tokenizer
        self._loaded: Any = None

    def __getstate__(self):
        return {"source": self.source, "_loaded": None}

    def wraps_same_tokenizer(self, other: Any) -> bool:
        """Whether ``other`` is an Encoder of the same tokenizer object or the same directory.

        >>> Encoder("/models/tok").wraps_same_tokenizer(Encoder("/models/tok"))
        True
        """
        if not isinstance(other, Encoder):
            return False
        return other.source is self.source or (isinstance(self.source, str) and other.source == self.source)

    @property
    def tokenizer(self) -> Any:
        """The tokenizer, loaded on first use (a name or directory through AutoTokenizer)."""
        if self._loaded is None:
            if isinstance(self.source, str):
                from transformers import AutoTokenizer

                self._loaded = AutoTokenizer.from_pretrained(self.source, local_files_only=True)
            else:
                self._loaded = self.source
        return self._loaded

    def encode(self, texts: List[str]) -> List[List[int]]:
        """Each text's token ids."""
        tok = self.tokenizer
        if hasattr(tok, "encode_batch"):  # tokenizers.Tokenizer
            return [e.ids for e in tok.encode_batch(texts)]
        return list(tok(texts, add_special_tokens=False)["input_ids"])

    def decode(self, ids: List[int]) -> str:
        """The text of the token ids ``ids``."""
        tok = self.tokenizer
        if hasattr(tok, "encode_batch"):  # tokenizers.Tokenizer: its decoder, else the tokens with spaces
            return tok.decode(ids) if tok.decoder is not None else " ".join(tok.id_to_token(i) for i in ids)
        return tok.decode(ids, skip_special_tokens=True)

    def _special(self, attribute: str, names: Tuple[str, ...]) -> Optional[int]:
        """A special token's id: the tokenizer's own ``attribute``, else the first of ``names`` it knows."""
        tok = self.tokenizer
        found = getattr(tok, attribute, None)
        lookup = getattr(tok, "token_to_id", None) or getattr(tok, "convert_tokens_to_ids", None)
        if found is None and lookup is not None:
            found = next((i for i in (lookup(n) for n in names) if isinstance(i, int)), None)
        return found

    def mask_id(self) -> int:
        """The token that hides a word from a masked language model."""
        found = self._special("mask_token_id", _MASK_NAMES)
        if found is None:
            raise DataError(f"task='masked-lm' needs a mask token: add one of {list(_MASK_NAMES)} to the "
                            "tokenizer's special tokens")
        return int(found)

    def vocab_size(self) -> int:
        """How many token ids the tokenizer knows."""
        tok = self.tokenizer
        return int(tok.get_vocab_size() if hasattr(tok, "get_vocab_size") else len(tok))

    def special_ids(self) -> Tuple[int, int]:
        """(end of sequence, padding): the tokenizer's own, else one of the usual token names."""
        eos, pad = self._special("eos_token_id", _END_NAMES), self._special("pad_token_id", _PAD_NAMES)
        if eos is None:
            raise DataError(f"the tokenizer has no end-of-sequence token: add one of {list(_END_NAMES)} to its "
                            "special tokens (documents are closed by it)")
        return int(eos), int(eos if pad is None else pad)


@dataclass(frozen=True)
class Masking:
    """Which tokens a masked language model must fill in: each of a row's real tokens (never end of
    sequence) with probability ``fraction``, at least one a row, chosen by ``seed`` and the row's own ids (the same
    rows get the same
    masks in every fit with that seed, so a resumed fit sees what the interrupted one saw).

    >>> Masking(mask_id=3, vocab_size=64, seed=0).fraction
    0.15
    """

    mask_id: int
    vocab_size: int
    seed: int = 0
    fraction: float = 0.15

    def apply(self, ids: List[int], real: int, eos_id: int) -> Tuple[List[int], List[int]]:
        """(the ids with some hidden, the labels: the hidden ids where they were, IGNORED elsewhere).

        >>> Masking(mask_id=0, vocab_size=9, seed=1, fraction=0.5).apply([5, 6, 7, 8, 1], 5, eos_id=1)
        ([0, 0, 3, 8, 1], [5, 6, 7, -100, -100])
        """
        import random
        import zlib

        rng = random.Random(zlib.crc32(bytes(str(ids[:real]), "ascii")) ^ self.seed)
        candidates = [i for i in range(real) if ids[i] != eos_id]
        chosen = [i for i in candidates if rng.random() < self.fraction]
        if not chosen and candidates:  # a row with nothing to fill in would teach nothing (a batch of them: no loss)
            chosen = [rng.choice(candidates)]
        inputs, labels = list(ids), [IGNORED] * len(ids)
        for i in chosen:
            labels[i] = ids[i]
            draw = rng.random()
            inputs[i] = self.mask_id if draw < 0.8 else rng.randrange(self.vocab_size) if draw < 0.9 else ids[i]
        return inputs, labels


@dataclass(frozen=True)
class TextLayout:
    """How documents become rows of token ids.

    >>> TextLayout("text", sequence_length=8, pack=True, eos_id=0, pad_id=1).sequence_length
    8
    """

    column: str
    sequence_length: int
    pack: bool
    eos_id: int
    pad_id: int
    keep: Tuple[str, ...] = ()      # columns carried to each document's row (labels): never with packing
    masking: Optional[Masking] = None  # a masked language model's hidden tokens: its labels


@dataclass(frozen=True)
class TokenCounts:
    """What tokenizing made of the DataFrame: rows (sequences), documents, real tokens kept, and
    tokens cut off (documents longer than the length, without packing)."""

    rows: int
    documents: int
    kept: int
    cut: int


def _row(ids: List[int], positions: List[int], documents: int, cut: int, layout: TextLayout) -> dict:
    real, length = len(ids), layout.sequence_length
    pad = length - real
    inputs, labels = ids + [layout.pad_id] * pad, ids + [IGNORED] * pad
    if layout.masking is not None:
        inputs, labels = layout.masking.apply(inputs, real, layout.eos_id)
    return {"input_ids": inputs, "position_ids": positions + [0] * pad,
            "attention_mask": [1] * real + [0] * pad, "labels": labels,
            "tokens": real, "cut": cut, "documents": documents}


def sequences(documents: List[List[int]], layout: TextLayout) -> Iterator[dict]:
    """The rows made of one partition's documents (each already closed by end of sequence).

    >>> layout = TextLayout("t", sequence_length=4, pack=True, eos_id=9, pad_id=0)
    >>> [r["input_ids"] for r in sequences([[1, 2, 9], [3, 9], [4, 5, 6, 9]], layout)]
    [[1, 2, 9, 3], [9, 4, 5, 6], [9, 0, 0, 0]]
    """
    length = layout.sequence_length
    if not layout.pack:
        for doc in documents:
            yield _row(doc[:length], list(range(min(len(doc), length))), 1, max(0, len(doc) - length), layout)
        return
    ids: List[int] = []
    positions: List[int] = []
    starts = 0
    for doc in documents:
        ids += doc
        positions += range(len(doc))
        starts += 1
        while len(ids) >= length:
            yield _row(ids[:length], positions[:length], starts, 0, layout)
            ids, positions, starts = ids[length:], positions[length:], 0
    if ids:
        yield _row(ids, positions, starts, 0, layout)


def tokenize_partitions(encoder: Encoder, layout: TextLayout, chunk_rows: int = 1024):
    """The function ``mapInArrow`` runs on each partition: text in, rows of token ids out."""
    def run(batches):
        import pyarrow as pa

        for batch in batches:
            texts = batch.column(layout.column).to_pylist()
            if any(t is None for t in texts):
                raise DataError(f"textCol {layout.column!r} has null values: drop or fill them before fit()")
            docs = [ids + [layout.eos_id] for ids in encoder.encode(texts)]
            rows = list(sequences(docs, layout)) if docs else []
            for start in range(0, len(rows), chunk_rows):
                part = rows[start:start + chunk_rows]
                kept = {name: batch.column(name).slice(start, len(part)) for name in layout.keep}
                yield pa.RecordBatch.from_pydict({
                    **{name: pa.array([r[name] for r in part], pa.list_(pa.int32())) for name in TOKEN_COLUMNS},
                    **{name: pa.array([r[name] for r in part], pa.int32()) for name in ("tokens", "cut", "documents")},
                    **kept})
    return run


def tokenize(df, encoder: Encoder, layout: TextLayout) -> Tuple[Any, TokenCounts]:
    """``df``'s text column as rows of token ids and what tokenizing made of it. Packing runs within
    each partition: a row never spans two. The first time, the rows are cached (the counts and
    prepare read them once each; the caller unpersists them); a second fit of the same DataFrame
    with the same tokenizer and layout knows the counts, and prepare finds the token ids it stored
    (keepData, a Tuner's trials): nothing is tokenized again."""
    from pyspark.sql import functions as F

    if layout.pack and layout.keep:
        raise DataError(f"packing mixes documents in one row: columns {list(layout.keep)} cannot follow them")
    fields = {f.name: f.dataType for f in df.schema.fields}
    schema = ", ".join([SCHEMA] + [f"`{name}` {fields[name].simpleString()}" for name in layout.keep])
    source = df.select(layout.column, *layout.keep)
    tokenized = source.mapInArrow(tokenize_partitions(encoder, layout), schema)
    key = _tokens_key(source, encoder, layout)
    with reuse_cache.preparing(key):
        known = _counted.get(key) if key is not None else None
        if known is not None:
            return tokenized, known
        tokenized = tokenized.cache()
        got = tokenized.agg(F.count("*"), F.sum("documents"), F.sum("tokens"), F.sum("cut")).collect()[0]
        counts = TokenCounts(rows=int(got[0]), documents=int(got[1] or 0), kept=int(got[2] or 0),
                             cut=int(got[3] or 0))
        if counts.rows == 0:
            raise DataError(f"textCol {layout.column!r}: the DataFrame has no rows to train on")
        if key is not None:
            _counted[key] = counts
        return tokenized, counts


_counted: Dict[Hashable, TokenCounts] = {}  # what tokenizing made of each DataFrame, in this session


def _tokens_key(source, encoder: Encoder, layout: TextLayout) -> Optional[Hashable]:
    """The text's plan and exactly how it is tokenized (the tokenizer's pickled bytes)."""
    import hashlib

    import cloudpickle

    try:
        plan = source.semanticHash()
    except Exception:  # noqa: BLE001 - no plan hash (Spark Connect variants): tokenize every time
        return None
    return ("tokens", plan, hashlib.sha256(cloudpickle.dumps((encoder, layout))).hexdigest())


def mean_tokens(counts: TokenCounts) -> float:
    """Real tokens per row, on average."""
    return counts.kept / counts.rows if counts.rows else 0.0

