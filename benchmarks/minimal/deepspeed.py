"""DeepSpeed: the loop of DeepSpeed's getting-started page (deepspeed.initialize, engine.backward, engine.step),
ZeRO stage 0 as dpcompare's default.

    deepspeed --no_local_rank --num_gpus 2 --module benchmarks.minimal.deepspeed
"""

import deepspeed
import torch
import torch.distributed as dist

from benchmarks.minimal.common import LR, MOMENTUM, SEED, dist_gather, leave, measure, mlp_512_1024, parse_args

args = parse_args()
deepspeed.init_distributed(dist_backend="gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
workload = mlp_512_1024(SEED)
loss_fn = workload.loss_fn
optimizer = torch.optim.SGD(workload.model.parameters(), lr=LR, momentum=MOMENTUM)
config = {"train_batch_size": args.global_batch, "train_micro_batch_size_per_gpu": args.global_batch // world_size,
          "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 0}, "steps_per_print": 1 << 30}
engine, _, _, _ = deepspeed.initialize(model=workload.model, optimizer=optimizer, config=config)


def train_step(x, y):
    loss = loss_fn(engine(x), y)
    engine.backward(loss)
    engine.step()


engine.train()
measure(train_step, workload, args, rank, world_size, dist.barrier, dist_gather)
dist.barrier()
leave()
