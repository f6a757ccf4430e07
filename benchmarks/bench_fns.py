"""Functions the benchmarks run on ranks (importable by Spark's workers by reference)."""
import time

import torch
import torch.distributed as dist

import sparkring.collective as sr


def trivial_allreduce():
    return sr.allreduce(torch.ones(1)).item()


def torch_distributor_trivial():
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


def allreduce_bandwidth(sizes, block_seconds=0.1, rounds=21):
    """Bus bandwidth (GB/s) of sr.allreduce / sr.allreduce_ vs dist.all_reduce on the same gloo
    group. Short blocks of each call alternate round after round, so a noisy moment on the
    shared cores hits one round of every method (in a rotating order); ratios are medians of per-round ratios.
    dist.all_reduce also runs against itself: that ratio is the measurement's noise floor."""
    import statistics

    out = []
    n = sr.size()
    for nbytes in sizes:
        t = torch.ones(nbytes // 4)
        methods = {"raw": lambda: dist.all_reduce(t), "ours": lambda: sr.allreduce(t, op=sr.Sum),
                   "raw_clone": lambda: dist.all_reduce(t.clone()),
                   "ours_inplace": lambda: sr.allreduce_(t, op=sr.Sum), "raw_again": lambda: dist.all_reduce(t)}
        # single calls spread over +-25% here: small and mid sizes get twice the rounds
        times = _rotating_blocks(methods, lambda: dist.all_reduce(t), rounds * 2 if nbytes <= (16 << 20) else rounds,
                                 block_seconds, min_iters=3)
        bus = lambda sec: 2 * (n - 1) / n * nbytes / sec / 1e9  # noqa: E731
        row = {"bytes": nbytes, **{k: bus(statistics.median(v)) for k, v in times.items()}}
        for ours, base in (("ours", "raw"), ("ours", "raw_clone"), ("ours_inplace", "raw"), ("raw_again", "raw")):
            row[f"{ours}/{base}"] = statistics.median(b / o for o, b in zip(times[ours], times[base]))
        out.append(row)
    return out


def _torch_share(value):
    box = torch.tensor([value])
    dist.broadcast(box, 0)
    return int(box)


def _rotating_blocks(methods, calibrate, rounds, block_seconds, min_iters, share=_torch_share, barrier=None):
    """Seconds per call of each method: blocks of calls alternate round after round in a
    rotating order (the position in a round has an effect of its own). Every rank runs the same
    number of calls per block, fixed by rank 0's estimate (``share`` sends it), so nothing
    synchronises inside a block."""
    barrier = barrier or dist.barrier
    for op in methods.values():
        op()
        op()
    start = time.perf_counter()
    for _ in range(3):
        calibrate()
    iters = share(min(2000, max(min_iters, round(block_seconds * 3 / (time.perf_counter() - start)))))
    times = {k: [] for k in methods}
    names = list(methods)
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            barrier()
            begin = time.perf_counter()
            for _ in range(iters):
                methods[k]()
            times[k].append((time.perf_counter() - begin) / iters)
    return times


def mpi_allreduce_overhead(sizes, block_seconds=0.1, rounds=15):
    """On backend="mpi": sr.allreduce vs mpi4py's out-of-place Allreduce into a preallocated
    result, sr.allreduce_ vs Allreduce(IN_PLACE), on the very communicator sparkring formed
    (alternating blocks, rotating order, medians)."""
    import statistics

    from mpi4py import MPI

    from sparkring.collective import _runtime

    comm = _runtime.current()._comm
    out = []
    for nbytes in sizes:
        t = torch.ones(nbytes // 4)
        a, result = t.numpy(), torch.empty_like(t).numpy()
        methods = {"raw": lambda: comm.Allreduce(MPI.IN_PLACE, a, MPI.SUM),
                   "raw_new": lambda: comm.Allreduce(a, result, MPI.SUM),
                   "ours": lambda: sr.allreduce(t, op=sr.Sum), "ours_inplace": lambda: sr.allreduce_(t, op=sr.Sum)}
        times = _rotating_blocks(methods, methods["raw"], rounds, block_seconds, min_iters=3,
                                 share=lambda v: comm.bcast(v, root=0), barrier=comm.Barrier)
        n = sr.size()
        bus = lambda sec: 2 * (n - 1) / n * nbytes / sec / 1e9  # noqa: E731
        row = {"bytes": nbytes, **{k: bus(statistics.median(v)) for k, v in times.items()}}
        for k, base in (("ours", "raw_new"), ("ours_inplace", "raw")):
            row[f"{k}/{base}"] = statistics.median(b / o for o, b in zip(times[k], times[base]))
        out.append(row)
    return out


def optimizer_vs_ddp(steps=60, width=1024, batch=64, rounds=20):
    from torch.nn.parallel import DistributedDataParallel as DDP

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(256, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                   torch.nn.ReLU(), torch.nn.Linear(width, 10))

    sr.init()  # forms the default process group DDP uses (run() leaves that to the function)
    x = torch.randn(batch, 256)
    y = torch.randint(0, 10, (batch,))
    ddp = DDP(make())
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    plain = make()
    ours_opt = sr.DistributedOptimizer(torch.optim.SGD(plain.parameters(), lr=0.01),
                                       named_parameters=plain.named_parameters())

    def step_ddp():
        ddp_opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        ddp_opt.step()

    def step_ours():
        ours_opt.zero_grad()
        torch.nn.functional.cross_entropy(plain(x), y).backward()
        ours_opt.step()

    for _ in range(5):
        step_ddp()
        step_ours()
    import statistics

    times = {"ddp": [], "ours": []}
    per_block = max(1, steps // 6)
    order = [("ddp", step_ddp), ("ours", step_ours)]
    for r in range(rounds):  # short alternating blocks; ratios are medians of per-block ratios
        for name, fn in order if r % 2 == 0 else order[::-1]:  # who goes first alternates too
            sr.barrier()
            start = time.perf_counter()
            for _ in range(per_block):
                fn()
            times[name].append(time.perf_counter() - start)
    out = {k: batch * sr.size() * per_block / statistics.median(v) for k, v in times.items()}
    out["ratio"] = statistics.median(d / o for d, o in zip(times["ddp"], times["ours"]))
    return out


def _rank_rows(files_by_rank, batch_size):
    """This rank's Parquet rows as tensors (pyarrow), and the steps every rank can take."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch
    import torch.distributed as dist

    table = pq.read_table(files_by_rank[dist.get_rank()])
    feats = table.column("features").combine_chunks()
    x = torch.from_numpy(feats.flatten().to_numpy().astype(np.float32).reshape(len(feats), -1))
    y = torch.from_numpy(table.column("label").to_numpy().astype(np.int64))
    n = torch.tensor([len(x)])
    dist.all_reduce(n, op=dist.ReduceOp.MIN)  # ranks must take the same number of steps
    return x, y, int(n) // batch_size


def _shuffled_epoch(model, opt, x, y, steps, batch_size):
    """One epoch of a hand-written loop: a permutation, ``steps`` batches, Adam."""
    import torch

    perm = torch.randperm(len(x))
    for i in range(steps):
        idx = perm[i * batch_size:(i + 1) * batch_size]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()


def ddp_parquet_training(files_by_rank, epochs, batch_size, lr):
    """Hand-written TorchDistributor loop: pyarrow reads the Parquet, DDP trains."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    x, y, steps = _rank_rows(files_by_rank, batch_size)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(x.shape[1], 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(epochs):
        _shuffled_epoch(model, opt, x, y, steps, batch_size)
    dist.destroy_process_group()
    return steps * batch_size * epochs


def ddp_training_loop(steps=120, width=1024, batch=64):
    """A plain DDP loop over the 1.3M-parameter MLP; returns rank 0's samples/s of the loop
    alone (the launcher's start-up is measured by the launch row)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(256, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                    torch.nn.ReLU(), torch.nn.Linear(width, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(batch, 256), torch.randint(0, 10, (batch,))

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(10):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    rate = steps * batch * dist.get_world_size() / (time.perf_counter() - start)
    dist.destroy_process_group()
    return rate


def agreement_cost(calls=400, nbytes=4096):
    """Per-call cost of the cross-rank agreement: a checked 4 KB allreduce (the public call)
    against the same allreduce without it (what DistributedOptimizer's buckets use)."""
    import statistics

    from sparkring.collective import _reduce

    t = torch.ones(nbytes // 4)

    def checked():
        _reduce.allreduce_now(t, _reduce.Sum)

    def unchecked():
        _reduce.allreduce_start(t, None, _reduce.Sum, blocking=True).wait()

    for fn in (checked, unchecked):
        for _ in range(20):
            fn()
    times = {"checked": [], "unchecked": []}
    for r in range(10):
        for name, fn in ((("checked", checked), ("unchecked", unchecked)) if r % 2 == 0
                         else (("unchecked", unchecked), ("checked", checked))):
            sr.barrier()
            start = time.perf_counter()
            for _ in range(calls // 10):
                fn()
            times[name].append((time.perf_counter() - start) / (calls // 10))
    return {k: statistics.median(v) for k, v in times.items()}


def sparse_vs_dense_embedding(rows=1_000_000, dim=64, ids_per_step=4096, rounds=8, per_block=3):
    """One embedding-bag step through DistributedOptimizer: sparse gradients exchanged as
    indices + values (allgather) vs densified first (sparse_as_dense=True, a 1M x 64 allreduce)."""
    sr.init()
    taken = {"sparse": 0, "dense": 0}  # both models see the same ids at the same step

    def make(sparse_as_dense):
        torch.manual_seed(0)
        emb = torch.nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)
        opt = sr.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.01),
                                      named_parameters=emb.named_parameters(), sparse_as_dense=sparse_as_dense)
        return emb, opt

    models = {"sparse": make(False), "dense": make(True)}

    def step(name):
        emb, opt = models[name]
        gen = torch.Generator().manual_seed(sr.rank() * 1_000_003 + taken[name])
        taken[name] += 1
        ids = torch.randint(0, rows, (ids_per_step,), generator=gen)
        opt.zero_grad()
        emb(ids, torch.arange(0, ids_per_step, 64)).sum().backward()
        opt.step()

    for name in models:
        step(name)
    import statistics

    times = {"sparse": [], "dense": []}
    order = ["sparse", "dense"]
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            sr.barrier()
            start = time.perf_counter()
            for _ in range(per_block):
                step(name)
            times[name].append((time.perf_counter() - start) / per_block)
    same = torch.allclose(models["sparse"][0].weight, models["dense"][0].weight, atol=1e-6)
    return {"sparse_s": statistics.median(times["sparse"]), "dense_s": statistics.median(times["dense"]),
            "same": bool(same)}


class MatrixFactorization(torch.nn.Module):
    """The recommender of examples/recommender.py: user/item embeddings, item bias, a dense column."""

    def __init__(self, users=2000, items=500, dim=8, sparse=True):
        super().__init__()
        torch.manual_seed(0)
        self.user = torch.nn.Embedding(users, dim, sparse=sparse)
        self.item = torch.nn.Embedding(items, dim, sparse=sparse)
        self.item_bias = torch.nn.Embedding(items, 1, sparse=sparse)
        self.dense = torch.nn.Linear(1, 1)

    def forward(self, user, item, activity):
        dot = (self.user(user) * self.item(item)).sum(1, keepdim=True)
        return dot + self.item_bias(item) + self.dense(activity)


def ddp_recommender_training(files_by_rank, epochs, batch_size, lr):
    """Hand-written TorchDistributor loop for the recommender: pyarrow reads the Parquet,
    DDP trains the same model with dense embedding gradients."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    table = pq.read_table(files_by_rank[rank])
    user = torch.from_numpy(table.column("user").to_numpy().astype(np.int64))
    item = torch.from_numpy(table.column("item").to_numpy().astype(np.int64))
    activity = torch.from_numpy(table.column("activity").to_numpy().astype(np.float32)).reshape(-1, 1)
    y = torch.from_numpy(table.column("clicked").to_numpy().astype(np.float32)).reshape(-1, 1)
    n = torch.tensor([len(y)])
    dist.all_reduce(n, op=dist.ReduceOp.MIN)
    steps = int(n) // batch_size
    model = DDP(MatrixFactorization(sparse=False))
    opt = torch.optim.Adagrad(model.parameters(), lr=lr)
    for _ in range(epochs):
        perm = torch.randperm(len(y))
        for i in range(steps):
            idx = perm[i * batch_size:(i + 1) * batch_size]
            opt.zero_grad()
            out = model(user[idx], item[idx], activity[idx])
            torch.nn.functional.binary_cross_entropy_with_logits(out, y[idx]).backward()
            opt.step()
    dist.destroy_process_group()
    return steps * batch_size * epochs


def barrier_rdd_task(_):
    """One task of a bare RDD barrier stage (the launch path before 2026-11-29): the rendezvous."""
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    ctx.allGather(str(ctx.partitionId()))
    yield ctx.partitionId()


def barrier_arrow_task(batches):
    """One task of a bare DataFrame barrier stage (mapInArrow, the launch path now): the rendezvous."""
    import pyarrow as pa
    from pyspark import BarrierTaskContext

    for _ in batches:
        pass
    ctx = BarrierTaskContext.get()
    ctx.allGather(str(ctx.partitionId()))
    yield pa.RecordBatch.from_pydict({"rank": [ctx.partitionId()]})


def shm_allreduce_bandwidth(sizes, block_seconds=0.1, rounds=9):
    """Bus bandwidth (GB/s) of sr.allreduce through shared memory vs dist.all_reduce (gloo) on
    the same ring, and one memcpy of the same bytes on every rank at once (the physical floor:
    a 2-rank shared-memory allreduce moves ~3.5x a memcpy's bytes). Alternating blocks,
    rotating order, medians of per-round ratios."""
    import statistics

    from sparkring.collective import _reduce, _runtime

    sr.init()
    ring = _runtime.current().single_host_ring()
    assert ring is not None, "the shared-memory path is off on this ring"
    out = []
    n = sr.size()
    for nbytes in sizes:
        t = torch.ones(nbytes // 4)
        dst = torch.empty_like(t)
        shard = torch.empty(t.numel() // n)
        methods = {"shm": lambda: sr.allreduce(t, op=sr.Sum), "gloo": lambda: dist.all_reduce(t),
                   "memcpy": lambda: dst.copy_(t),
                   # as DistributedOptimizer's buckets call it: arguments agreed once, not per call
                   "shm_agreed": lambda: _reduce.allreduce_start(t, None, _reduce.Sum, blocking=True).wait(),
                   "shm_bcast": lambda: sr.broadcast_(dst, root_rank=0),
                   "gloo_bcast": lambda: dist.broadcast(dst, src=0),
                   # FSDP2's two exchanges on gloo, over the same bytes (the whole unsharded tensor)
                   "gloo_reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, t),
                   "gloo_all_gather": lambda: dist.all_gather_into_tensor(dst, shard),
                   "shm_reduce_scatter": lambda: ring.reduce_scatter_sum(t, shard),
                   "shm_all_gather": lambda: ring.all_gather_into(shard, dst)}
        times = _rotating_blocks(methods, lambda: dist.all_reduce(t), rounds, block_seconds, min_iters=2)
        bus = lambda sec: 2 * (n - 1) / n * nbytes / sec / 1e9  # noqa: E731
        row = {"bytes": nbytes, **{k: statistics.median(v) for k, v in times.items()}}
        row["shm_bus"], row["gloo_bus"] = bus(row["shm"]), bus(row["gloo"])
        row["shm_agreed_bus"] = bus(row["shm_agreed"])
        row["shm/gloo"] = statistics.median(g / s for s, g in zip(times["shm"], times["gloo"]))
        row["bcast_shm/gloo"] = statistics.median(g / s for s, g in zip(times["shm_bcast"], times["gloo_bcast"]))
        row["shm/memcpy"] = statistics.median(s / m for s, m in zip(times["shm"], times["memcpy"]))
        for kind in ("reduce_scatter", "all_gather"):  # FSDP2's exchanges (sparkring.collective.fsdp)
            row[f"{kind}_shm/gloo"] = statistics.median(g / s for s, g in zip(times[f"shm_{kind}"],
                                                                            times[f"gloo_{kind}"]))
        out.append(row)
    return out


def _layer_stack(d_in, width, layers, classes):
    import torch

    blocks = [torch.nn.Linear(d_in, width), torch.nn.ReLU()]
    for _ in range(layers - 1):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(width, classes))


def _shard_by_layer(model, mesh):
    """FSDP2 the way a user writes it: each layer with parameters, then the whole model."""
    from torch.distributed.fsdp import fully_shard

    for block in model:
        if any(True for _ in block.parameters()):
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def fsdp_parquet_training(files_by_rank, epochs, batch_size, lr, width, layers, checkpoint_dir):
    """Hand-written FSDP2 loop under TorchDistributor: pyarrow reads the rank's Parquet files,
    fully_shard per layer, Adam, a DCP checkpoint after every epoch (what fit() does)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    x, y, steps = _rank_rows(files_by_rank, batch_size)
    size = dist.get_world_size()
    mesh = init_device_mesh("cpu", (size,))
    torch.manual_seed(0)
    model = _layer_stack(x.shape[1], width, layers, 10)
    _shard_by_layer(model, mesh)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for epoch in range(epochs):
        _shuffled_epoch(model, opt, x, y, steps, batch_size)
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=f"{checkpoint_dir}/epoch-{epoch}")
    dist.destroy_process_group()
    return steps * batch_size * epochs


def training_state_per_rank(sharded, width=512, layers=6):
    """Bytes of parameters + gradients + Adam state one rank keeps after a step, sharded or not."""
    import torch

    import sparkring.collective as sr

    torch.manual_seed(0)
    model = _layer_stack(64, width, layers, 10)
    if sharded:
        mesh = sr.device_mesh()
        _shard_by_layer(model, mesh)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        opt = sr.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                      named_parameters=model.named_parameters())
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(torch.randn(32, 64)), torch.randint(0, 10, (32,))).backward()
    opt.step()
    seen, total = set(), 0
    tensors = [t for p in model.parameters() for t in (p, p.grad)]
    tensors += [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return sr.allgather_object(total)  # every rank's, by rank


def checkpoint_times(directory, width=1024, layers=8, reps=3):
    """Seconds training waits for one checkpoint: sharded DCP (sync, and async until it returns)
    and rank 0's torch.save of the gathered full state, each the median of ``reps``."""
    import statistics
    import time

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    import sparkring.collective as sr

    torch.manual_seed(0)
    model = _layer_stack(64, width, layers, 10)
    mesh = sr.device_mesh()
    _shard_by_layer(model, mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    torch.nn.functional.cross_entropy(model(torch.randn(8, 64)), torch.randint(0, 10, (8,))).backward()
    opt.step()
    group = dist.new_group(backend="gloo")
    out = {"sync": [], "async": [], "full": []}
    for i in range(reps):
        sr.barrier()
        t0 = time.perf_counter()
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=f"{directory}/sync-{i}")
        sr.barrier()
        out["sync"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        future = dcp.async_save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                                checkpoint_id=f"{directory}/async-{i}", process_group=group)
        out["async"].append(time.perf_counter() - t0)
        future.result()
        sr.barrier()
        t0 = time.perf_counter()
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = {"model": get_model_state_dict(model, options=options),
                 "optim": get_optimizer_state_dict(model, opt, options=options)}
        if sr.rank() == 0:
            torch.save(state, f"{directory}/full-{i}.pt")
        sr.barrier()
        out["full"].append(time.perf_counter() - t0)
    params = sum(p.numel() for p in model.parameters())
    return {k: statistics.median(v) for k, v in out.items()} | {"params": params}


class DiesOnceAt(torch.nn.Module):
    """A 3-layer MLP whose rank 1 process exits at its ``at``-th training step the first time
    (writing the time to ``died``); after the relaunch, the first training step of any rank
    writes its time to ``back``: the time a lost rank costs until training goes on."""

    def __init__(self, died: str, back: str, at: int, d: int = 64, width: int = 256, classes: int = 10):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(d, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                       torch.nn.ReLU(), torch.nn.Linear(width, classes))
        self.died, self.back, self.at, self.steps = died, back, at, 0

    @staticmethod
    def _stamp(path):
        try:
            with open(path, "x") as f:
                f.write(repr(time.time()))
        except FileExistsError:
            pass

    def forward(self, x):
        import os

        if self.training:
            self.steps += 1
            if not os.path.exists(self.died):
                if self.steps == self.at and sr.rank() == 1:
                    self._stamp(self.died)
                    os._exit(3)
            elif not os.path.exists(self.back):
                self._stamp(self.back)
        return self.net(x)


class CountsSteps(torch.nn.Module):
    """A 3-layer MLP whose training steps take at least ``seconds`` each; every rank process
    appends one line per training step to ``<audit>/<its pid>.txt`` (the decommission benchmark
    counts the steps each launch took)."""

    def __init__(self, audit: str, seconds: float, d: int = 64, width: int = 64, classes: int = 10):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(d, width), torch.nn.ReLU(), torch.nn.Linear(width, classes))
        self.audit, self.seconds = audit, seconds

    def forward(self, x):
        import os

        if self.training:
            with open(os.path.join(self.audit, f"{os.getpid()}.txt"), "a") as f:
                f.write(f"{time.time()!r}\n")
            time.sleep(self.seconds)
        return self.net(x)


def elastic_steps(stamps: str, steps: int = 4000):
    """Horovod-elastic training of a small MLP, one commit a step; rank 0 appends
    "<its pid> <time>" to ``stamps`` after each step (the lost-executor benchmark reads when
    the next launch's rank 0, another process, trains)."""
    import os

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = sr.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters())
    state = sr.elastic.TorchState(model, opt, step=0)

    @sr.elastic.run
    def train(state):
        x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
        with open(stamps, "a") as out:
            while state.step < steps:
                opt.zero_grad()
                torch.nn.functional.cross_entropy(state.model(x), y).backward()
                opt.step()
                state.step += 1
                state.commit()
                if sr.rank() == 0:
                    out.write(f"{os.getpid()} {time.time()!r}\n")
                    out.flush()
                time.sleep(0.005)
    train(state)
    return state.step


def _tp_plan(layers):
    """The layer stack's Linears in colwise/rowwise pairs (the last, odd one stays whole)."""
    linears = [str(2 * i) for i in range(layers + 1)]
    return {name: ("colwise" if i % 2 == 0 else "rowwise") for i, name in enumerate(linears[:layers - layers % 2])}


def tp_parquet_training(files, epochs, batch_size, lr, width, layers, checkpoint_dir):
    """Hand-written tensor parallelism under TorchDistributor: every rank of the group reads the same
    rows (pyarrow), parallelize_module splits the Linears in colwise/rowwise pairs, Adam, a DCP
    checkpoint after every epoch (what fit(tensorParallel=2) does)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dist.init_process_group("gloo")
    size = dist.get_world_size()
    x, y, steps = _rank_rows([files] * size, batch_size)
    mesh = init_device_mesh("cpu", (size,))
    torch.manual_seed(0)
    model = _layer_stack(x.shape[1], width, layers, 10)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, mesh, {name: styles[s]() for name, s in _tp_plan(layers).items()})
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for epoch in range(epochs):
        torch.manual_seed(epoch)  # the group's ranks take the same rows in the same order
        _shuffled_epoch(model, opt, x, y, steps, batch_size)
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=f"{checkpoint_dir}/epoch-{epoch}")
    dist.destroy_process_group()
    return steps * batch_size * epochs
