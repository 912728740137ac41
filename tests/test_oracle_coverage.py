"""The oracle coverage (`--check-coverage`): what the float64 oracle checks when its memory would not fit.

Checked against: the memory model's own arithmetic (a budget that holds every parameter's checks gives full
coverage; a smaller one gives whole blocks in the stated order — first block, last block, the parameters outside the
blocks, then the middles — whose planned need fits the budget), and real runs: a tiny Llama-style config checked on
a share of its blocks is `equivalent` with the coverage stated in the verdict, the note and the run's line. Negatives:
a fault confined to the first block (tests/faulty_adapters.py:FirstBlockScaledReference, its gradient 5 % large) is
`different` when coverage checks that block; the same fault in the last block is missed when coverage leaves that
block out (the stated blind spot), and caught at full coverage; `full` that does not fit, a subset under
--clip-grad-norm and a budget below one block are each refused in one line, exit 2, no traceback.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpcompare.verify.memory import oracle_coverage as oc

from test_hf_models import configs, write_configs  # noqa: F401  (the fixture)


class Stack(nn.Module):
    """An embedding, six blocks in a ModuleList and a head: the shape of a transformer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))
        self.head = nn.Linear(8, 3)


def test_units_are_taken_first_last_outside_then_the_middles() -> None:
    order = [u for u, _ in oc.units(Stack())]
    assert order == ["blocks.0", "blocks.5", "(outside the blocks)", "blocks.2", "blocks.1", "blocks.3", "blocks.4"]
    members = dict(oc.units(Stack()))
    assert members["(outside the blocks)"] == ["embed.weight", "head.weight", "head.bias"]


def test_a_budget_that_holds_everything_checks_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DPCOMPARE_VERIFY_MEMORY_GIB", "100")
    plan = oc.plan(Stack(), request="auto", optimizer="sgd", dtype_bytes=4, device=torch.device("cpu"))
    assert plan.full and plan.fraction == 1.0 and plan.checked_parameters == plan.parameters


def test_a_smaller_budget_checks_the_whole_blocks_that_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Sequential(*(nn.Linear(512, 512) for _ in range(8)))  # 8 blocks of 262 656 parameters
    total = sum(p.numel() for p in model.parameters())
    block = total // 8
    budget = oc.need_bytes(total, 3 * block, "sgd") + 1  # three blocks' checks, not four
    monkeypatch.setenv("DPCOMPARE_VERIFY_MEMORY_GIB", str(budget / oc.MARGIN / oc.GIB))
    plan = oc.plan(model, request="auto", optimizer="sgd", dtype_bytes=4, device=torch.device("cpu"))
    assert plan.units_checked == ["0", "7", "3"] and plan.checked_parameters == 3 * block
    assert plan.need_bytes <= budget and len(plan.unchecked) == 10 and "auto" in plan.reason
    # a share asked for: whole blocks up to it, in the same order
    monkeypatch.setenv("DPCOMPARE_VERIFY_MEMORY_GIB", "100")
    quarter = oc.plan(model, request="0.25", optimizer="sgd", dtype_bytes=4, device=torch.device("cpu"))
    assert quarter.units_checked == ["0", "7"] and quarter.fraction == 0.25 and quarter.reason.endswith("requested")


def test_ranks_sharing_the_forwards_are_planned_in_the_memory_they_share() -> None:
    """With the oracle's forwards divided over the ranks, the other ranks' copies take room from rank 0's plan where
    they share its memory (one host's CPU ranks), and a pool too small for its ranks' copies is refused, naming them."""
    model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(8)))  # planned, never run
    total = sum(p.numel() for p in model.parameters())
    block = total // 8
    copies = oc.helper_bytes(oc.copied_elements(model), optimizer="sgd", ranks=2)
    kw = dict(request="auto", optimizer="sgd", dtype_bytes=4, device=torch.device("cpu"))
    alone = oc.plan_ranks(model, [("host", (oc.need_bytes(total, total, "sgd") / oc.MARGIN * 1.01, "test"))], **kw)
    assert alone.full
    # rank 0's share at two ranks fits, not beside the other rank's copies on the same host
    free = (oc.need_bytes(total, total, "sgd", ranks=2) + copies * 0.9) / oc.MARGIN
    assert oc.need_bytes(total, total, "sgd", ranks=2) < oc.need_bytes(total, total, "sgd")  # its ranges divided
    shared = oc.plan_ranks(model, [("host", (free, "test")), ("host", (free, "test"))], **kw)
    assert not shared.full and shared.checked_parameters < total and "other ranks' copies" in shared.reason
    apart = oc.plan_ranks(model, [("host", (free, "test")), ("other", (copies / oc.MARGIN * 1.01, "test"))], **kw)
    assert apart.full  # a rank on a host of its own takes nothing from rank 0's
    with pytest.raises(oc.OracleCoverageRefused, match=r"rank\(s\) 1, 2 hold copies") as refused:
        oc.plan_ranks(model, [("host", (free, "test")), ("other", (copies, "test")), ("other", (copies, "test"))],
                      **kw)
    assert "--oracle-ranks rank0" in str(refused.value)
    assert block > 0


@pytest.mark.parametrize(("request_", "partial", "gib", "says"), [
    ("full", None, 0.05, "cannot check every parameter"),
    ("auto", "--clip-grad-norm clips by the global norm", 0.05, "a subset cannot be checked here"),
    ("auto", None, 1e-4, "cannot check even one block"),
])
def test_what_cannot_fit_is_refused_with_the_figures(monkeypatch: pytest.MonkeyPatch, request_: str,
                                                     partial: str | None, gib: float, says: str) -> None:
    model = nn.Sequential(*(nn.Linear(512, 512) for _ in range(8)))
    monkeypatch.setenv("DPCOMPARE_VERIFY_MEMORY_GIB", str(gib))
    with pytest.raises(oc.OracleCoverageRefused, match=says) as refused:
        oc.plan(model, request=request_, optimizer="sgd", dtype_bytes=4, device=torch.device("cpu"),
                refuse_partial=partial)
    assert "GiB" in str(refused.value) and "--check-every 0" in str(refused.value)


def test_the_frozen_template_computes_no_gradient_for_what_is_left_out() -> None:
    model = Stack()
    oc.unchecked_frozen(model, frozenset({"blocks.1.weight", "blocks.1.bias"}))
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == ["blocks.1.weight", "blocks.1.bias"]


# -- real runs ----------------------------------------------------------------------------------------------
def _run(launch, backend: str, model: str, *extra: str, env_gib: str | None = None):
    if env_gib is not None:
        import os

        os.environ["DPCOMPARE_VERIFY_MEMORY_GIB"] = env_gib
    try:
        return launch(backend, 1, model, ["--seq-len", "16", "--measure-steps", "0", *extra])
    finally:
        if env_gib is not None:
            del os.environ["DPCOMPARE_VERIFY_MEMORY_GIB"]


def test_a_share_of_the_blocks_is_checked_and_stated_and_a_fault_there_is_caught(launch, configs) -> None:  # noqa: F811
    spec = f"hf:{configs['llama']}"
    done, result = _run(launch, "reference", spec, "--check-coverage", "0.4")
    assert done.returncode == 0, done.output[-3000:]
    e = result["equivalence"]
    assert e["verdict"] == "equivalent" and e["oracle_coverage"]["units_checked"] == ["model.layers.0"]
    assert 0.3 < e["oracle_coverage"]["fraction"] < 0.4 and any(n["code"] == "oracle_coverage" for n in e["notes"])
    assert "ORACLE COVERAGE 35%" in done.stdout
    m = result["metrics"]  # what checking cost rank 0, recorded with no measured step too
    assert m["measured_steps"] == 0 and m["verify_steps"] == 4 and m["verify_checked_steps"] == 4
    assert m["verify_ms_per_step"] > 0 and m["verify_peak_mib"] > 0 and m["verify_above_start_mib"] > 0
    # the run's own state first allocated in the phase (SGD with momentum: a float32 gradient and momentum buffer per
    # parameter) is stated apart, and the rest is the checks'
    own = 8 * result["model_info"]["parameters"] / 2**20
    assert abs(m["verify_run_state_mib"] - own) <= 0.01 * own, (m["verify_run_state_mib"], own)
    assert m["verify_checking_mib"] == pytest.approx(m["verify_above_start_mib"] - m["verify_run_state_mib"])
    # where that time went: the oracle's forwards and each check that ran, adding up to no more than the whole
    parts = m["verify_ms_by_part"]
    assert {"oracle", "gradient", "update", "trajectory"} <= set(parts) and all(v >= 0 for v in parts.values())
    assert parts["oracle"] > 0 and parts["update"] > 0 and sum(parts.values()) <= m["verify_ms_per_step"], parts
    # the negative: the first block's gradient 5 % large, with that block checked
    done, result = _run(launch, "tests.faulty_adapters:FirstBlockScaledReference", spec, "--check-coverage", "0.4")
    assert done.returncode == 0, done.output[-3000:]
    e = result["equivalence"]
    assert e["verdict"] == "different" and e["first_divergence"]["parameter"].startswith("model.layers.0.")


@pytest.mark.slow  # breadth: the default tier keeps this capability's other test
def test_too_little_memory_for_any_block_is_one_line(launch, configs) -> None:  # noqa: F811
    done, result = _run(launch, "reference", f"hf:{configs['llama']}", env_gib="0.0001")
    assert done.returncode == 2 and result is None
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "cannot check even one block" in lines[0] and "Traceback" not in done.stderr


@pytest.mark.slow
def test_a_fault_in_a_block_coverage_leaves_out_is_missed_and_full_coverage_catches_it(launch, configs) -> None:  # noqa: F811
    spec = f"hf:{configs['llama']}"
    done, result = _run(launch, "tests.faulty_adapters:LastBlockScaledReference", spec, "--check-coverage", "0.4")
    assert done.returncode == 0, done.output[-3000:]
    assert result["equivalence"]["verdict"] == "equivalent"  # the blind spot the coverage states
    assert "model.layers.1" in result["equivalence"]["oracle_coverage"]["units_unchecked"]
    done, result = _run(launch, "tests.faulty_adapters:LastBlockScaledReference", spec)
    e = result["equivalence"]
    assert e["verdict"] == "different" and e["first_divergence"]["parameter"].startswith("model.layers.1.")


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_refusal_at_two_ranks_is_said_once_by_rank_0(launch, configs) -> None:  # noqa: F811
    import os

    os.environ["DPCOMPARE_VERIFY_MEMORY_GIB"] = "0.0001"
    try:
        done, result = launch("ddp", 2, f"hf:{configs['llama']}", ["--seq-len", "16"], launcher="torchrun")
    finally:
        del os.environ["DPCOMPARE_VERIFY_MEMORY_GIB"]
    assert done.returncode != 0 and result is None
    said = [line for line in done.stderr.splitlines() if line.startswith("dpcompare: error")]
    assert len(said) == 1 and "cannot check even one block" in said[0] and "[rank" not in said[0]
