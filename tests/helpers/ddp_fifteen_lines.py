"""The 15-line DDP script of the torchrun issue: env:// init, DDP over a Linear, five steps."""
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo", init_method="env://")
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step * 10 + dist.get_rank()))
    opt.zero_grad(); model(x).pow(2).sum().backward(); opt.step()
w = model.module.weight.detach().clone()
gathered = [torch.zeros_like(w) for _ in range(dist.get_world_size())]
dist.all_gather(gathered, w)
print("equal across ranks:", all(torch.equal(gathered[0], g) for g in gathered))
dist.destroy_process_group()
