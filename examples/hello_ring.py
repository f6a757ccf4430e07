"""A plain training-style script that uses sparkring.collective the way a Horovod script
uses horovod.torch. Run it on two ranks of a local Spark:

    python -m sparkring run -np 2 examples/hello_ring.py --steps 3
"""
import argparse
import sys

import torch

import sparkring.collective as sr

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--exit-code", type=int, default=0, help="exit with this status (for tests)")
args = parser.parse_args()

sr.init()
torch.manual_seed(sr.rank())
model = torch.nn.Linear(4, 1)
sr.broadcast_parameters(model.state_dict(), root_rank=0)
opt = sr.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                              named_parameters=model.named_parameters())
for step in range(args.steps):
    x = torch.randn(8, 4)
    loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    mean_loss = sr.allreduce(loss.detach(), name="loss").item()
    if sr.rank() == 0:
        print(f"step {step} loss {mean_loss:.4f} on {sr.size()} ranks")
checksum = sr.allgather(model.weight.detach().reshape(1, -1))
same = bool(torch.allclose(checksum[0], checksum[-1]))
if sr.rank() == 0:
    print(f"weights identical on all ranks: {same}")
sys.exit(args.exit_code)
