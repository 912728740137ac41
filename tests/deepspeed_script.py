"""A user's own DeepSpeed training script, not dpcompare's: one process on the CPU, a plain MLP, torch's AdamW with two
parameter groups (weight decay on the weights alone), `engine.save_checkpoint(folder)` with DeepSpeed's own tag and
`latest` file. It dumps the engine's whole state read through DeepSpeed's own API (`safe_get_full_fp32_param`,
`safe_get_full_optimizer_state`, the optimizer's groups) for tests/test_convert.py to compare a conversion with.

    python tests/deepspeed_script.py save FOLDER STAGE DUMP      train 3 steps, save, dump
    python tests/deepspeed_script.py load FOLDER STAGE DUMP TAG  a fresh engine loads a universal checkpoint, dump
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn


def _engine(stage: int, universal: bool):
    import deepspeed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29611"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    optimizer = torch.optim.AdamW([{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}],
                                  lr=1e-2)
    config = {"train_batch_size": 4, "zero_optimization": {"stage": stage}, "checkpoint": {"load_universal": universal}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _dump(engine, path: str) -> None:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)  # ZeRO-1/2: linked on first use
    if link is not None:
        link()
    state = {}
    for name, p in engine.module.named_parameters():
        state[name] = {"fp32": safe_get_full_fp32_param(p).clone(),
                       **{k: safe_get_full_optimizer_state(p, k).clone() for k in ("exp_avg", "exp_avg_sq")}}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.optimizer.param_groups]
    torch.save({"params": state, "groups": groups, "global_steps": engine.global_steps}, path)


def main(argv: list[str]) -> None:
    op, folder, stage, dump = argv[0], argv[1], int(argv[2]), argv[3]
    engine = _engine(stage, universal=op == "load")
    if op == "save":
        torch.manual_seed(1)
        for _ in range(3):
            loss = engine(torch.randn(4, 6)).square().mean()
            engine.backward(loss)
            engine.step()
        engine.save_checkpoint(folder)
    else:
        path, _ = engine.load_checkpoint(folder, tag=argv[4])
        assert path is not None, f"DeepSpeed loaded nothing from {folder}"
    _dump(engine, dump)


if __name__ == "__main__":
    main(sys.argv[1:])
