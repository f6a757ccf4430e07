"""A plain DDP training script, written for torchrun, run unchanged by sparkring.

    torchrun --nproc_per_node=2 examples/ddp_script.py --epochs 3          # the usual way
    python -m sparkring run -np 2 examples/ddp_script.py --epochs 3        # on Spark, same file
    python -m sparkring run --remote sc://host:15002 -np 2 examples/ddp_script.py

It uses only torch: env:// initialisation, DistributedSampler with set_epoch, DDP, no_sync()
for gradient accumulation, and a rank-0 checkpoint.
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--checkpoint", default=None, help="rank 0 saves the model here")
    args = parser.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    y = (x @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(512, 1, generator=g))
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(device)
    model = DDP(model, device_ids=[local_rank] if backend == "nccl" else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total, batches = 0.0, 0
        for i, (xb, yb) in enumerate(loader):
            xb, yb = xb.to(device), yb.to(device)
            last_micro = (i + 1) % args.accumulate == 0
            if last_micro:
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                loss.backward()
                opt.step()
                opt.zero_grad()
            else:
                with model.no_sync():  # accumulate locally, reduce with the next micro-batch
                    loss = torch.nn.functional.mse_loss(model(xb), yb)
                    loss.backward()
            total += loss.item()
            batches += 1
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} loss {total / batches:.4f} on {world} ranks", flush=True)

    weights = torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()
    gathered = [torch.zeros_like(weights) for _ in range(world)] if rank == 0 else None
    dist.gather_object(weights, gathered if rank == 0 else None, dst=0)
    if rank == 0:
        print("weights identical on all ranks:", all(torch.equal(gathered[0], w) for w in gathered), flush=True)
        if args.checkpoint:
            torch.save(model.module.state_dict(), args.checkpoint)
            print(f"saved {args.checkpoint}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
