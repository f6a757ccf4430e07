"""Models and rank functions for the sharded-training tests (importable by Spark's workers)."""
import torch

import sparkring.collective as sr
from sparkring.collective.fsdp import SharedMemoryAllGather, SharedMemoryReduceScatter, use_shared_memory
from sparkring.trainer.measure import state_bytes


def layer_stack(d=8, width=32, layers=3, classes=3):
    """A model factory: a stack of layers, so FSDP2 shards (and gathers) one layer at a time."""
    def build():
        blocks = [torch.nn.Linear(d, width), torch.nn.ReLU()]
        for _ in range(layers - 1):
            blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        return torch.nn.Sequential(*blocks, torch.nn.Linear(width, classes))
    return build


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


def uses_meta_values():
    """A factory whose own initialization reads values, which the meta device has none of."""
    model = torch.nn.Linear(4, 2)
    model.weight.data[0, 0] = float(model.bias.sum())
    return model


def sparse_embeddings():
    return torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Flatten(), torch.nn.Linear(8, 2))


class _KeptInFloat32(torch.nn.Module):
    """A block of a float32 and a bfloat16 layer, as from_pretrained(torch_dtype=torch.bfloat16) leaves a
    Hugging Face model that keeps some modules in float32."""

    def __init__(self):
        super().__init__()
        self.kept = torch.nn.Linear(8, 16)
        self.body = torch.nn.Linear(16, 3).to(torch.bfloat16)

    def forward(self, x):
        return self.body(torch.relu(self.kept(x)).to(torch.bfloat16)).float()


def mixed_dtypes():
    """A model factory whose one block holds parameters of two dtypes."""
    return torch.nn.Sequential(_KeptInFloat32())


def _training_state_bytes(model, opt):
    """Parameters, gradients and optimizer state this rank keeps (storage sizes: see state_bytes)."""
    return sum(state_bytes(model, opt))


def sharded_training_in_run(sharded, width=256, layers=4, steps=3):
    """device_mesh() + fully_shard by hand inside run(); what each rank keeps, and the losses."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = layer_stack(d=16, width=width, layers=layers, classes=4)()
    full_params = sum(p.numel() for p in model.parameters())
    if sharded:
        mesh = sr.device_mesh()
        for block in model:
            if any(True for _ in block.parameters()):
                fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        routed = use_shared_memory(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        sr.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = sr.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                      named_parameters=model.named_parameters())
    torch.manual_seed(1 + sr.rank())
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    return {"full_params": full_params, "local_params": local, "state_bytes": _training_state_bytes(model, opt),
            "full_state_bytes": full_params * 4 * 4, "losses": losses,
            "mesh": str(sr.device_mesh().mesh.tolist()) if sharded else None,
            "shared_memory": ((routed, SharedMemoryAllGather.served, SharedMemoryReduceScatter.served) if sharded
                              else None)}


def hybrid_sharded_training(steps=3):
    """HSDP by hand: device_mesh(hybrid=True) on 2 hosts x 2 ranks, parameters sharded within a host
    and replicated across hosts; the losses, what each rank keeps, and the final weights."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = layer_stack(d=8, width=16, layers=2, classes=3)()
    mesh = sr.device_mesh(hybrid=True)
    for block in model:
        if any(True for _ in block.parameters()):
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + sr.rank())
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"mesh": mesh.mesh.tolist(), "names": mesh.mesh_dim_names,
            "local": sum(p.to_local().numel() for p in model.parameters()),
            "total": sum(p.numel() for p in model.parameters()), "weights": full}


def hybrid_reference(size=4, steps=3):
    """One process, every rank's batch: what hybrid_sharded_training must end with."""
    torch.manual_seed(0)
    model = layer_stack(d=8, width=16, layers=2, classes=3)()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = []
    for r in range(size):
        torch.manual_seed(1 + r)
        batches.append((torch.randn(8, 8), torch.randint(0, 3, (8,))))
    for _ in range(steps):
        opt.zero_grad()
        (sum(torch.nn.functional.cross_entropy(model(x), y) for x, y in batches) / size).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
