"""DDP: the loop of torch's "Getting Started with DDP" tutorial (torchrun sets the rendezvous variables).

    torchrun --standalone --nproc_per_node=2 -m benchmarks.minimal.ddp
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.minimal.common import LR, MOMENTUM, SEED, dist_gather, leave, measure, mlp_512_1024, parse_args

args = parse_args()
dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
workload = mlp_512_1024(SEED)
model, loss_fn = DDP(workload.model), workload.loss_fn
optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def train_step(x, y):
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


model.train()
measure(train_step, workload, args, rank, world_size, dist.barrier, dist_gather)
dist.barrier()
dist.destroy_process_group()
leave()
