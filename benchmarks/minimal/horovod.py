"""Horovod: the loop of Horovod's PyTorch guide (hvd.init, DistributedOptimizer, broadcast_parameters).

    horovodrun --gloo -np 2 -H localhost:2 python -m benchmarks.minimal.horovod
"""

import horovod.torch as hvd
import torch

from benchmarks.minimal.common import LR, MOMENTUM, SEED, leave, measure, mlp_512_1024, parse_args

args = parse_args()
hvd.init()
workload = mlp_512_1024(SEED)
model, loss_fn = workload.model, workload.loss_fn
optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), op=hvd.Average)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)


def train_step(x, y):
    optimizer.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()


model.train()
measure(train_step, workload, args, hvd.rank(), hvd.size(), lambda: hvd.allreduce(torch.zeros(1), name="barrier"),
        lambda obj: hvd.allgather_object(obj))
hvd.shutdown()
leave()
