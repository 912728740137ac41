"""Named experiments: functions that return a RunConfig, printed as command-line arguments (RunConfig.to_args: the
backend left to the command line).

Use them under any launcher (the launcher decides rank and world size, the experiment the rest):

    torchrun --nproc_per_node=2 -m dpcompare $(python experiments/configs.py lm_adamw) --backend ddp
    python experiments/configs.py --list
"""

from __future__ import annotations

import sys

from dpcompare.run.config import RunConfig


def quick_check() -> RunConfig:
    """The default: a 4-step MLP run, every step checked against the oracle."""
    return RunConfig()


def cnn_syncbn() -> RunConfig:
    """BatchNorm with global-batch statistics: must be `equivalent` at any world size."""
    return RunConfig(model="cnn", sync_bn=True, steps=4)


def lm_adamw() -> RunConfig:
    """The causal LM with AdamW and weight decay, checked every step, then 30 measured steps."""
    return RunConfig(model="lm", optimizer="adamw", lr=1e-3, weight_decay=0.01, steps=6, measure_steps=30)


def lm_accumulate_fp16() -> RunConfig:
    """Gradient accumulation over 4 micro-batches with fp16 gradients on the wire."""
    return RunConfig(model="lm", grad_accum=4, compression="fp16", global_batch=32, steps=4)


def gpt_bf16() -> RunConfig:
    """GPT-tiny as GPU clusters train it: bf16 autocast, AdamW, dropout on (its masks captured), 4 checked steps."""
    return RunConfig(model="gpt-tiny", amp="bf16", optimizer="adamw", lr=1e-3, steps=4)


def fp16_overflow() -> RunConfig:
    """fp16 with an initial loss scale of 2^24: the first steps overflow and every backend must skip exactly those."""
    return RunConfig(model="mlp", amp="fp16", loss_scale=2.0**24, steps=8, measure_steps=0)


def measure_mlp() -> RunConfig:
    """Cost only: one checked step, then 50 measured steps and 50 ablation pairs."""
    return RunConfig(model="mlp", steps=1, measure_steps=50, warmup_steps=5)


EXPERIMENTS = {f.__name__: f for f in (quick_check, cnn_syncbn, lm_adamw, lm_accumulate_fp16, gpt_bf16, fp16_overflow,
                                        measure_mlp)}
if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help", "--list"):
        print("usage: python experiments/configs.py NAME\n" +
              "\n".join(f"  {name:20s} {fn.__doc__}" for name, fn in EXPERIMENTS.items()))
        raise SystemExit(0 if len(sys.argv) == 2 else 2)
    if sys.argv[1] not in EXPERIMENTS:
        print(f"experiments/configs.py: unknown experiment {sys.argv[1]!r}: choose one of {', '.join(EXPERIMENTS)}",
              file=sys.stderr)
        raise SystemExit(2)
    print(" ".join(EXPERIMENTS[sys.argv[1]]().to_args(leave_out=("backend",))))
