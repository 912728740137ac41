"""Activation checkpointing's memory, side by side: the same DDP run of a GPT with and without
--activation-checkpointing, in alternation, on this machine.

    cd /work/main && OMP_NUM_THREADS=1 .venv/bin/python -m pytest benchmarks/test_activation_checkpointing.py -s -p no:cacheprovider

gpt-mini (4 blocks, context 256, 256 wide, dropout 0.1), global batch 24 over 2 ranks, one verification step (the
float64 oracle replays each rank's dropout masks), one warm-up step, 3 measured steps, no ablation. The figures:
rank 1's peak_mem_mib (on CPU its resident high-water mark over the measured steps: rank 0 also keeps resident what
its checks allocated before the window, which the allocator may or may not hand back, so its peak says more about
that than about the step), peak_above_start_mib (the highest rank's rise above what it held when the window opened:
on CPU from the resident size, which memory the allocator kept from earlier steps hides), and step_ms_p50 for the
recomputation's price. Checkpointing must lower rank 1's peak in every round.
"""

from __future__ import annotations

from benchmarks.conftest import Runner, alternate, paired_ratios, print_table, spread

ROUNDS = 2
ARGS = ["--backend", "ddp", "--model", "gpt-mini", "--steps", "1", "--warmup-steps", "1", "--measure-steps", "3",
        "--ablation-steps", "0", "--timeout-s", "900"]


def test_checkpointing_lowers_the_peak_memory(runner: Runner) -> None:
    results = alternate({"plain": lambda: runner.dpcompare(ARGS, "plain"),
                         "checkpointed": lambda: runner.dpcompare([*ARGS, "--activation-checkpointing"], "ckpt")},
                        ROUNDS)
    figures = {side: {"rank1_peak_mem_mib": [r["peak_mem_mib_per_rank"][1] for r in runs],
                      **{k: [r[k] for r in runs] for k in ("peak_above_start_mib", "step_ms_p50")}}
               for side, runs in results.items()}
    rows = []
    for side, f in figures.items():
        rows += [(f"{side} rank 1 peak_mem_mib", spread(f["rank1_peak_mem_mib"]), "the rank without the checks"),
                 (f"{side} peak_above_start_mib", spread(f["peak_above_start_mib"]), "the highest rank's rise"),
                 (f"{side} step_ms_p50", spread(f["step_ms_p50"]), "")]
    rows.append(("checkpointed / plain step time", spread(paired_ratios(figures["checkpointed"]["step_ms_p50"],
                                                                        figures["plain"]["step_ms_p50"])), "per round"))
    print_table("gpt-mini, ddp, world size 2: with and without --activation-checkpointing", rows)
    below = zip(figures["checkpointed"]["rank1_peak_mem_mib"], figures["plain"]["rank1_peak_mem_mib"], strict=True)
    assert all(c < p for c, p in below), figures
