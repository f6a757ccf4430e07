"""Train a small decoder-only transformer (Llama's block shape) on text already on this machine (the
docstrings of Python's standard library) to predict the next character, twice on 2 CPU ranks: with
its layers split across both ranks (tensorParallel=2) and as a two-stage pipeline
(pipelineParallel=2). Offline; prints each fit's held-out next-character accuracy.

    python examples/model_parallel.py            # local[2]
    python examples/model_parallel.py --fast     # fewer rows and epochs
"""
import argparse
import os
import sys
import tempfile

import torch
from pyspark.ml.linalg import Vectors
from pyspark.sql import SparkSession

from sparkring import SparkRingEstimator, Store

parser = argparse.ArgumentParser()
parser.add_argument("--fast", action="store_true")
args = parser.parse_args()
ROWS, EPOCHS, CONTEXT = (2000, 3, 16) if args.fast else (12000, 6, 24)


class RMSNorm(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(torch.nn.Module):
    """Pre-norm attention and a gated MLP, with Hugging Face Llama's names: the default
    tensor-parallel plan splits q/k/v/gate/up by output features and o/down by input features.
    The heads come from the local width, so a rank holding half of q/k/v computes half the heads."""

    def __init__(self, dim=64, heads=4, hidden=128):
        super().__init__()
        self.head_dim = dim // heads
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(dim), RMSNorm(dim)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (torch.nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.gate_proj = torch.nn.Linear(dim, hidden, bias=False)
        self.up_proj = torch.nn.Linear(dim, hidden, bias=False)
        self.down_proj = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.input_layernorm(x)
        q, k, v = (p(h).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(torch.nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


class Embed(torch.nn.Embedding):
    def forward(self, ids):
        return super().forward(ids.long())


class LastPosition(torch.nn.Module):
    def forward(self, x):
        return x[:, -1]


VOCAB = 96  # printable ASCII, shifted to 0..95


def decoder(layers=4, dim=64):
    """An nn.Sequential, so a pipeline keeps each stage's modules (and tensor parallelism splits them)."""
    return torch.nn.Sequential(Embed(VOCAB, dim), *[Block(dim) for _ in range(layers)], RMSNorm(dim),
                               torch.nn.Linear(dim, VOCAB, bias=False), LastPosition())


def corpus():
    """The docstrings of some standard-library modules, as codes 0..95."""
    import collections
    import functools
    import inspect
    import itertools
    import json
    import pathlib
    import textwrap

    text = " ".join(inspect.getdoc(obj) or "" for module in (collections, functools, itertools, json, pathlib, textwrap)
                    for _, obj in inspect.getmembers(module) if inspect.isfunction(obj) or inspect.isclass(obj))
    return [min(max(ord(c) - 32, 0), VOCAB - 1) for c in " ".join(text.split())]


os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
builder = SparkSession.builder.appName("sparkring model parallel")
if "spark.master" not in SparkSession.builder._options and not os.environ.get("SPARK_ENV_LOADED"):
    builder = builder.master("local[2]")
spark = (builder.config("spark.driver.host", os.environ.get("SPARK_LOCAL_IP", "127.0.0.1"))
         .config("spark.ui.showConsoleProgress", "false").getOrCreate())
spark.sparkContext.setLogLevel("ERROR")

codes = corpus()
step = max(1, (len(codes) - CONTEXT - 1) // ROWS)
rows = [(Vectors.dense(codes[i:i + CONTEXT]), float(codes[i + CONTEXT]))
        for i in range(0, len(codes) - CONTEXT - 1, step)][:ROWS]
df = spark.createDataFrame(rows, ["features", "label"])
train, test = df.randomSplit([0.9, 0.1], seed=3)
common = test.groupBy("label").count().orderBy("count", ascending=False).first()["count"] / test.count()
print(f"{len(rows)} contexts of {CONTEXT} characters; most common next character: {common:.3f} of held-out rows")

store = Store(tempfile.mkdtemp(prefix="model-parallel-store-"))
layouts = {"tensorParallel=2": dict(tensorParallel=2),
           "pipelineParallel=2": dict(pipelineParallel=2, pipelineSchedule="1f1b", microbatches=4)}
for name, layout in layouts.items():
    est = SparkRingEstimator(model=decoder, optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
                             loss="cross_entropy", metrics=["accuracy"], batchSize=64, epochs=EPOCHS, numProc=2,
                             seed=0, store=store, verbose=1, activationCheckpointing="selective", **layout)
    model = est.fit(train)
    predicted = model.transform(test)
    accuracy = predicted.filter("prediction = label").count() / predicted.count()
    losses = " ".join(f"{h['loss']:.2f}" for h in model.history)
    print(f"{name}: training loss by epoch {losses}; held-out next-character accuracy {accuracy:.3f} "
          f"(most common character: {common:.3f}); per-rank parameters + Adam state "
          f"{model.history[-1]['state_bytes'] / 1e6:.2f} MB")
