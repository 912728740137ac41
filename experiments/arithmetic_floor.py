"""The checks' arithmetic floor at a batch, in steps: what a checked step cannot do without on this machine.

At one process a checked step computes, beside the run's own step, two float64 forwards and backwards of the global
batch (the oracle's, at the run's weights; the reference trajectory's float64 copy's, at its own) and one forward and
backward in the run's precision (the run-precision reference, which the trajectory's run-precision copy takes at one
rank). The oracle's float64 gradient is taken for the trajectory at the first step only: later the two copies' weights
differ. So, timed here on a Llama-style config of benchmarks/test_verification_cost.py (one thread, alternating, the
median of each):

    floor = (2 * T(float64 forward + backward) + T(float32 forward + backward)) / T(float32 step)

Over a run's N checked steps the first takes the oracle's float64 gradient for the trajectory, so its floor is
(2N - 1) float64 passes and N float32 ones over N steps (`--checked-steps`, the run's default 4).

The step is the forward, backward and momentum SGD step in float32, its loss the model's own (`labels`), as the run's.
The float64 copy is prepared as the checks prepare theirs (dpcompare.verify.oracle.float64_paths): transformers'
upcasts for half precision (`.float()` in its RMSNorm, softmax and loss) stay float64, so its loss is taken in float64
where the model's own code would narrow float64 logits to float32. The checks' measured cost per checked step
(`metrics.verify_ms_per_step` / `step_ms_p50`) cannot fall below the floor over its checked steps without removing one
of those passes; everything above it is the comparisons, the replays and the copies.

    OMP_NUM_THREADS=1 python experiments/arithmetic_floor.py [--size 11M] [--batch 24] [--seq-len 128] [--repeats 3] \\
        [--checked-steps 4]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.test_verification_cost import SIZES  # noqa: E402
from dpcompare.verify.oracle import float64_paths  # noqa: E402


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="11M", choices=[s.label for s in SIZES])
    parser.add_argument("--batch", type=int, default=24)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--checked-steps", type=int, default=4)
    args = parser.parse_args(argv)
    if args.batch < 1 or args.seq_len < 2 or args.repeats < 1 or args.checked_steps < 1:
        print("arithmetic_floor: --batch, --repeats and --checked-steps must be at least 1 and --seq-len at least 2",
              file=sys.stderr)
        return 2
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.set_num_threads(1)
    size = next(s for s in SIZES if s.label == args.size)
    with tempfile.TemporaryDirectory() as tmp:
        config = LlamaConfig.from_pretrained(str(size.write(Path(tmp))))
    torch.manual_seed(0)
    model32 = AutoModelForCausalLM.from_config(config)
    model64 = float64_paths.prepare(copy.deepcopy(model32).double())
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq_len))
    sgd = torch.optim.SGD(model32.parameters(), lr=1e-3, momentum=0.9)

    def forward_backward(model) -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    def step() -> None:
        model32(input_ids=ids, labels=ids).loss.backward()
        sgd.step()
        sgd.zero_grad(set_to_none=True)

    step()  # warm: the momentum allocated, the kernels chosen
    forward_backward(model64)
    times: dict[str, list[float]] = {"step": [], "fb32": [], "fb64": []}
    for _ in range(args.repeats):  # alternating: a shared machine's drift falls on every figure alike
        times["step"].append(_timed(step))
        times["fb32"].append(_timed(lambda: forward_backward(model32)))
        times["fb64"].append(_timed(lambda: forward_backward(model64)))
    med = {k: statistics.median(v) for k, v in times.items()}
    params = sum(p.numel() for p in model32.parameters())
    print(f"{args.size} ({params:,} parameters), {args.batch} x {args.seq_len} tokens, one thread, "
          f"{args.repeats} alternating readings each (ms): "
          + "; ".join(f"{k} {', '.join(f'{t * 1e3:.0f}' for t in v)}" for k, v in times.items()))
    print(f"median: step {med['step'] * 1e3:.0f} ms, float32 forward+backward {med['fb32'] * 1e3:.0f} ms, "
          f"float64 forward+backward {med['fb64'] * 1e3:.0f} ms ({med['fb64'] / med['fb32']:.2f}x float32's)")
    print(f"floor = (2 x float64 + float32 forward+backward) / step = "
          f"{(2 * med['fb64'] + med['fb32']) / med['step']:.2f} steps per checked step")
    n = args.checked_steps
    print(f"over {n} checked steps, the first taking the oracle's float64 gradient: ({2 * n - 1} x float64 + {n} x "
          f"float32) / {n} steps = {((2 * n - 1) * med['fb64'] + n * med['fb32']) / (n * med['step']):.2f} "
          f"steps per checked step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
