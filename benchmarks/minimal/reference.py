"""Reference: one process, the whole global batch, the plain PyTorch loop of the torch tutorials."""

import torch

from benchmarks.minimal.common import LR, MOMENTUM, SEED, measure, mlp_512_1024, parse_args

args = parse_args()
workload = mlp_512_1024(SEED)
model, loss_fn = workload.model, workload.loss_fn
optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def train_step(x, y):
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


model.train()
measure(train_step, workload, args, 0, 1, lambda: None, lambda obj: [obj])
