"""Models and rank functions for the model-parallel tests (importable by Spark's workers)."""
import os

import torch

import sparkring.collective as sr


def mlp(d=8, width=32, classes=3):
    """A factory: Linear-ReLU-Linear-ReLU-Linear; the plan MLP_PLAN splits the first two Linears."""
    def build():
        return torch.nn.Sequential(torch.nn.Linear(d, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                   torch.nn.ReLU(), torch.nn.Linear(width, classes))
    return build


MLP_PLAN = {"0": "colwise", "2": "rowwise"}


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


class RMSNorm(torch.nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def reset_parameters(self):
        torch.nn.init.ones_(self.weight)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(torch.nn.Module):
    """Llama-style causal self-attention (Hugging Face's names); heads follow the local q/k/v width,
    so a tensor-parallel rank computes its own heads."""

    def __init__(self, dim, heads):
        super().__init__()
        self.head_dim = dim // heads
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.o_proj = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, -1, self.head_dim).transpose(1, 2) for proj in (self.q_proj, self.k_proj,
                                                                                         self.v_proj))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(torch.nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate_proj = torch.nn.Linear(dim, hidden, bias=False)
        self.up_proj = torch.nn.Linear(dim, hidden, bias=False)
        self.down_proj = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(torch.nn.Module):
    def __init__(self, dim, heads, hidden):
        super().__init__()
        self.input_layernorm, self.self_attn = RMSNorm(dim), Attention(dim, heads)
        self.post_attention_layernorm, self.mlp = RMSNorm(dim), MLP(dim, hidden)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyDecoder(torch.nn.Module):
    """A decoder-only transformer of Llama's shape over a small vocabulary: token ids in, the
    next-token logits of the last position out (a sequence classifier over the vocabulary)."""

    def __init__(self, vocab=16, dim=32, heads=4, hidden=64, layers=2, length=8):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = self.embed_tokens(ids.long())
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))[:, -1]


def tiny_decoder():
    return TinyDecoder()


def tensor_parallel_in_run(steps=3):
    """device_mesh(tp=2) + parallelize_module by hand inside run(): each rank's share of the
    weights, the losses, and the whole weights after training (gathered)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = sr.device_mesh(tp=2)
    torch.manual_seed(0)
    model = mlp(d=8, width=64)()
    model = parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    losses = _train_on_reference_batch(model, steps)
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach() for k, v in model.state_dict().items()}
    return {"names": mesh.mesh_dim_names, "mesh": mesh.mesh.tolist(), "local": local, "losses": losses,
            "weights": full}


def _train_on_reference_batch(model, steps):
    """``steps`` SGD steps on reference_batch(); the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = reference_batch()
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def reference_batch():
    g = torch.Generator().manual_seed(5)
    return torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)


def tensor_parallel_reference(steps=3):
    """What tensor_parallel_in_run trains, in one process."""
    torch.manual_seed(0)
    model = mlp(d=8, width=64)()
    losses = _train_on_reference_batch(model, steps)
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def mesh_layout(tp, pp=1):
    """The (pp, dp, tp) mesh this rank is part of, as lists."""
    mesh = sr.device_mesh(tp=tp, pp=pp)
    return {"mesh": mesh.mesh.tolist(), "names": mesh.mesh_dim_names, "tp_group": mesh["tp"].mesh.tolist(),
            "dp_group": mesh["dp"].mesh.tolist()}


def counting_sequences_df(spark, n=256, length=8, vocab=16, seed=0):
    """Token sequences that count up from a random start (mod vocab): the label is the next token."""
    import numpy as np
    from pyspark.ml.linalg import Vectors

    starts = np.random.default_rng(seed).integers(0, vocab, size=n)
    rows = [(i, Vectors.dense([(s + k) % vocab for k in range(length)]), float((s + length) % vocab))
            for i, s in enumerate(starts.tolist())]
    return spark.createDataFrame(rows, ["id", "features", "label"]).repartition(2, "id")


class NaNAtCall(torch.nn.Module):
    """No parameters: its input, turned NaN at the given forward calls (0-based, training only)."""

    def __init__(self, calls):
        super().__init__()
        self.calls, self.n = set(calls), 0

    def forward(self, x):
        if self.training:
            x = x * float("nan") if self.n in self.calls else x
            self.n += 1
        return x


def mlp_nan_at(calls):
    """mlp() whose output (computed by a pipeline's last stage) turns NaN at ``calls``."""
    def build():
        return torch.nn.Sequential(*mlp(width=64)(), NaNAtCall(calls))
    return build


class ExitsOnce(torch.nn.Module):
    """No parameters: the process of global rank ``rank`` exits at its ``at``-th training forward
    call (1-based), the first time only (a marker file remembers): a lost rank, not an exception."""

    def __init__(self, marker, rank, at):
        super().__init__()
        self.marker, self.rank, self.at, self.n = marker, rank, at, 0

    def forward(self, x):
        if self.training:
            self.n += 1
            if self.n == self.at and sr.rank() == self.rank and not os.path.exists(self.marker):
                open(self.marker, "w").close()
                os._exit(3)
        return x


def mlp_exits_once(marker, rank, at):
    """mlp(width=64) whose rank ``rank`` process dies once at its ``at``-th step (same state as mlp())."""
    def build():
        return torch.nn.Sequential(*mlp(width=64)(), ExitsOnce(marker, rank, at))
    return build
