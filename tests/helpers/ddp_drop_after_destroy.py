"""A rank's user code, many times over, in the shape that deadlocked Gloo's teardown: DDP trains,
destroy_process_group(), and the model is dropped at once (its Reducer let go of the group last).
Then one call that makes and destroys its group many times: the kept groups must not pile up."""
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from sparkring.collective import hosting


def user_code(rounds=1):
    for _ in range(rounds):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        model = DDP(torch.nn.Linear(4, 2))
        for _ in range(3):
            model(torch.randn(8, 4)).sum().backward()
        dist.destroy_process_group()
        del model


for _ in range(int(sys.argv[1])):
    hosting.before_user_code()
    hosting.call_user_code(user_code, (), None)
    hosting.after_user_code()
print("all returned")
hosting.before_user_code()
hosting.call_user_code(user_code, (40,), None)
print("threads after 40 groups in one call:", len(os.listdir("/proc/self/task")))
hosting.after_user_code()
