"""Rank functions for the Horovod conformance tests (run through tests/spawn.py)."""
import torch

import sparkring.collective as hvd


def reinit_twice():
    first = hvd.allreduce(torch.ones(3), op=hvd.Sum)
    opt = hvd.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1))
    hvd.shutdown()
    hvd.init()
    second = hvd.allreduce(torch.ones(3) * (hvd.rank() + 1), op=hvd.Sum)
    hvd.shutdown()
    hvd.init()
    third = hvd.allgather(torch.tensor([hvd.rank()]))
    del opt
    return {"first": first, "second": second, "third": third}


def trivial():
    return hvd.rank()


DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.bool]


def dtype_probe():
    out = {}
    for dt in DTYPES:
        t = (torch.arange(6) % 2 + hvd.rank()).to(dt)
        for name, fn in [("allreduce", lambda: hvd.allreduce(t, op=hvd.Sum)),
                         ("allreduce_avg", lambda: hvd.allreduce(t)),
                         ("allgather", lambda: hvd.allgather(t)),
                         ("broadcast", lambda: hvd.broadcast(t, 0)),
                         ("alltoall", lambda: hvd.alltoall(t)),
                         ("reducescatter", lambda: hvd.reducescatter(t, op=hvd.Sum))]:
            try:
                fn()
                out[(str(dt), name)] = "ok"
            except Exception as e:
                out[(str(dt), name)] = f"{type(e).__name__}: {str(e)[:80]}"
    return out


def every_dtype_against_a_direct_computation():
    """Each collective, each dtype Horovod supports, against what it must compute."""
    size, me = hvd.size(), hvd.rank()
    out = {}
    for dt in DTYPES:
        base = lambda r: ((torch.arange(6) % 3) + r).to(dt)  # noqa: E731
        mine = base(me)
        everyone = [base(r) for r in range(size)]
        got = {}
        if dt != torch.bool:
            got["sum"] = (hvd.allreduce(mine, op=hvd.Sum), sum(x.double() for x in everyone).to(dt))
            got["min"] = (hvd.allreduce(mine, op=hvd.Min), torch.stack(everyone).min(0).values)
            got["max"] = (hvd.allreduce(mine, op=hvd.Max), torch.stack(everyone).max(0).values)
        got["allgather"] = (hvd.allgather(mine), torch.cat(everyone))
        got["broadcast"] = (hvd.broadcast(mine, root_rank=size - 1), everyone[-1])
        out[str(dt)] = got
    return out


def integer_average_and_scaling():
    """Horovod's integer rules: Average truncates toward zero, scale factors keep the dtype."""
    r = hvd.rank()
    t = torch.tensor([-3, 3, 7, -7], dtype=torch.int32) * (r + 1)  # sums over 2 ranks: -9 9 21 -21
    return {"avg": hvd.allreduce(t, op=hvd.Average),
            "pre": hvd.allreduce(t, op=hvd.Sum, prescale_factor=0.5),
            "post": hvd.allreduce(t, op=hvd.Sum, postscale_factor=0.5),
            "int16": hvd.allreduce(t.to(torch.int16), op=hvd.Sum)}
