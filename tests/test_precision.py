"""Mixed precision (--amp bf16|fp16): every backend's recipe is judged against the float64 oracle.

Checks, against what each part must produce:
  - the loss scaler (dpcompare.contract.amp.GradScaling) counts a skipped step exactly when the scale backs off;
  - the noise floor of a mixed-precision run recomputes the recipe rank by rank at the step's loss scale, so it
    overflows where a rank overflows, which the global batch in one forward does not (its negative twin);
  - the diagnosis names a loss scale that was never undone, or undone twice, with the factor, and a plain scale
    factor stays `scaled` when the run has no loss scale (the twin that must not fire);
  - an optimizer step count that is not the expected one is found exactly;
  - real runs at world size 2 under their native launchers: bf16 autocast under ddp, DeepSpeed's bf16 engine with
    its fp32 master weights (the update check judged on them), a forced fp16 overflow (initial scale 2^24) that
    Horovod skips exactly where the oracle's emulation of the ranks overflows, and the planted faults
    (tests/faulty_adapters.py): scale never undone, undone twice, stepping on inf, skipping a finite step.

Tiers: the default tier runs one recipe per kind (autocast, engine, a forced overflow) and one planted fault; the
`slow` tier runs every backend x {bf16, fp16} x {mlp, gpt-tiny}, the other faults, every backend skipping the same
steps, gradient accumulation, and DeepSpeed's bf16 engine with AdamW (its optimizer starts at step count 1).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dpcompare.run import workloads
from dpcompare.contract.amp import GradScaling
from dpcompare.verify.oracle import gradient_oracle as eq
from dpcompare.verify.diagnosis.diagnose import step_count_mismatch
from dpcompare.verify.diagnosis.state_comparison import state_difference
from dpcompare.verify.judgement.precision_recipe import Recipe
from test_diagnosis import _diagnoses, _linear

CPU = torch.device("cpu")
FORCED = ["--amp", "fp16", "--loss-scale", str(2**24)]


# -- the loss scaler ----------------------------------------------------------------------------------------
def test_grad_scaling_counts_a_skip_only_when_the_scale_backs_off() -> None:
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaling = GradScaling(CPU, 2.0**10)
    scaling.scale(model(torch.randn(3, 4)).sum()).backward()
    scaling.unscale(opt)
    scaling.step(opt)
    assert scaling.state().skipped_steps == 0 and scaling.state().scale == 2.0**10
    opt.zero_grad()
    scaling.scale(model(torch.randn(3, 4)).sum()).backward()
    model.weight.grad[0, 0] = math.inf
    before = [p.detach().clone() for p in model.parameters()]
    scaling.unscale(opt)
    scaling.step(opt)
    assert scaling.state().skipped_steps == 1 and scaling.state().scale == 2.0**9
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())), "a skipped step moved the weights"


# -- weights gathered in the amp dtype (DeepSpeed ZeRO-3 under torch_autocast) -----------------------------------
class _TiedEmbedding(nn.Module):
    """A head tied to an embedding: autocast narrows the head's matmul, never the embedding's lookup."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(x))).float().mean(dim=1)


def _tied_grads(gathered: frozenset[str], rounded_by_hand: bool = False) -> eq.Grads:
    torch.manual_seed(0)
    model = _TiedEmbedding()
    if rounded_by_hand:
        with torch.no_grad():
            model.embed.weight.copy_(model.embed.weight.bfloat16().float())
    x, y = torch.randint(0, 11, (6, 5)), torch.randn(6, 11)
    pieces = eq.global_pieces((x, y))
    return eq.accumulate_gradient(model, nn.functional.mse_loss, pieces, CPU,
                                  recipe=Recipe("autocast", "bf16", "cpu", lambda: gathered))[0]


def test_gathered_parameters_are_rounded_in_every_op_for_the_forward_only() -> None:
    """The recipe's forward sees a gathered parameter rounded to bf16 in every op (the embedding lookup too), as if
    it were stored rounded; after the forward and backward the parameter holds its own float32 values again."""
    torch.manual_seed(0)
    probe = _TiedEmbedding()
    kept = probe.embed.weight.detach().clone()
    with Recipe("autocast", "bf16", "cpu", lambda: frozenset({"embed.weight"})).gathering(probe):
        assert torch.equal(probe.embed.weight, kept.bfloat16().float())
    assert torch.equal(probe.embed.weight, kept), "the parameter's own values were not restored"
    gathered = _tied_grads(frozenset({"embed.weight"}))
    by_hand = _tied_grads(frozenset(), rounded_by_hand=True)
    plain = _tied_grads(frozenset())
    assert torch.equal(gathered["embed.weight"], by_hand["embed.weight"])
    # the negative: without the rounding the lookup computes on float32 values, a different gradient
    assert eq.rel_fro(gathered["embed.weight"], plain["embed.weight"], 0.0) > 1e-4


def test_a_partial_wire_rounds_only_the_parameters_it_carries() -> None:
    """DeepSpeed ZeRO under torch_autocast reduces Linear and Conv gradients in bf16 and the others in float32: the
    reference sends only the declared ones through the wire; the others match the reference without a wire."""
    w, (x, y) = _mlp_batch()
    oracle = eq.Oracle(w.model, w.loss_fn, "float32", CPU, Recipe("autocast", "bf16"))
    state = {k: v.double() if v.is_floating_point() else v for k, v in w.model.state_dict().items()}
    pieces = [eq.Piece(x[r::2], y[r::2], 0.5, rank=r) for r in range(2)]
    names = oracle.names
    wired = frozenset(names[:1])
    unsent: eq.Grads = {}
    partial = oracle.wire_floor_of(state, pieces, torch.bfloat16, wired=wired, unsent=unsent)
    full = oracle.wire_floor_of(state, pieces, torch.bfloat16)
    for n in names:
        holds_bf16 = torch.equal(partial[n], partial[n].bfloat16().double())
        assert holds_bf16 == (n in wired), f"{n}: only a wired sum holds bf16 values"
        if n not in wired:
            assert eq.rel_fro(partial[n], unsent[n], 0.0) < 1e-6, n  # float32's rounding only
            assert eq.rel_fro(full[n], unsent[n], 0.0) > 1e-4, n  # the negative: the full wire rounds it


def test_deepspeeds_unscaled_fp16_loss_at_stage_0_is_recognised_from_its_source() -> None:
    """DeepSpeed 0.19.8's engine.backward() scales the loss only for a ZeRO optimizer (deepspeedai/DeepSpeed#8393, seen
    on an H200: every ZeRO-0 fp16 update the loss scale times too small). The note says so where the source lacks the
    fp16 branch, and not where it has one."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.engine import DeepSpeedEngine

    from dpcompare.adapters.deepspeed_config import stage0_fp16_loss_unscaled

    class Fixed:
        def backward(self, loss):
            if isinstance(self.optimizer, object):
                loss = self.optimizer.scale_if_loss(loss)
            elif self.fp16_enabled() and not self.zero_optimization():
                loss = self.optimizer.cur_scale * loss
            return loss

    class Unfixed:
        def backward(self, loss):
            return self.optimizer.scale_if_loss(loss)

    import deepspeed
    from packaging.version import Version

    assert stage0_fp16_loss_unscaled(DeepSpeedEngine) == (Version(deepspeed.__version__) <= Version("0.19.8"))
    assert stage0_fp16_loss_unscaled(Unfixed) and not stage0_fp16_loss_unscaled(Fixed)
    assert not stage0_fp16_loss_unscaled(int)  # no readable backward: said nothing


def test_module_boundaries_change_the_graph_not_the_values() -> None:
    """ZeRO-3's hooks pass every module's inputs and outputs through an identity autograd function; the reference's
    boundaries do the same: the same loss, a boundary node in the graph at every module, every parameter's gradient a
    gradient of the same function (float64: equal to rounding), and the hooks gone afterwards."""
    from dpcompare.verify.oracle.module_boundaries import module_boundaries

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)  # so the first module's input is in the graph too
    plain = model(x).square().sum()
    grads = torch.autograd.grad(plain, list(model.parameters()))
    with module_boundaries(model):
        bounded = model(x).square().sum()
        assert _graph_names(bounded).count("_BoundaryBackward") == 2 * len(list(model.modules()))
        again = torch.autograd.grad(bounded, list(model.parameters()))
    assert float(plain.detach()) == float(bounded.detach())
    assert all(torch.allclose(a, b, rtol=1e-12, atol=0) for a, b in zip(grads, again))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()), "hooks left behind"
    # the negative: switched off, no boundary is drawn
    with module_boundaries(model, enabled=False):
        assert "_BoundaryBackward" not in _graph_names(model(x).sum())


def _graph_names(t: torch.Tensor) -> str:
    seen, names, stack = set(), [], [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack += [n for n, _ in node.next_functions]
    return " ".join(names)


# -- the recipe's floor -------------------------------------------------------------------------------------
def _mlp_batch():
    w = workloads.mlp(1234)
    return w, w.make_batch(0, 24)


def _recipe_grads(w, batch, pieces, scale: float) -> eq.Grads:
    model = eq.verification_copy(w.model, CPU, torch.float32)
    return eq.accumulate_gradient(model, w.loss_fn, pieces, CPU, recipe=Recipe("autocast", "fp16"), loss_scale=scale)[0]


def _finite(grads: eq.Grads) -> bool:
    return all(bool(torch.isfinite(g).all()) for g in grads.values())


def test_the_recipe_floor_runs_each_rank_as_it_ran() -> None:
    """Rank by rank: each rank's loss times S (and 1/grad_accum) in the graph, the sum over ranks divided by N and S
    afterwards: the same numbers as doing it by hand."""
    w, batch = _mlp_batch()
    layout = eq.Layout(2, 2)
    pieces = eq.replica_pieces(batch, layout)
    got = _recipe_grads(w, batch, pieces, 2.0**8)
    model = eq.verification_copy(w.model, CPU, torch.float32)
    for _, _, _, idx in layout.positions(24):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = w.loss_fn(model(batch[0][idx]), batch[1][idx])
        (loss.float() * (2.0**8 / 2)).backward()
    for n, p in model.named_parameters():
        assert torch.equal(got[n], p.grad.double() / (2 * 2.0**8)), n


def test_the_recipe_floor_overflows_where_a_rank_does_and_the_global_batch_does_not() -> None:
    """A rank's local loss is a mean over 1/N of the samples: its per-sample gradients are N times the global
    batch's, so a rank overflows at a scale N times smaller. The negative twin: the global batch in one forward
    misses that overflow, so a floor computed that way would predict no skip where every backend must skip."""
    w, batch = _mlp_batch()
    ranks = eq.replica_pieces(batch, eq.Layout(2, 1))
    whole = eq.global_pieces(batch)
    scales = [2.0**e for e in range(8, 31)]
    first_rank = next(s for s in scales if not _finite(_recipe_grads(w, batch, ranks, s)))
    first_whole = next(s for s in scales if not _finite(_recipe_grads(w, batch, whole, s)))
    assert first_rank < first_whole, (first_rank, first_whole)
    assert not _finite(_recipe_grads(w, batch, ranks, first_rank))
    assert _finite(_recipe_grads(w, batch, whole, first_rank))


def test_the_engine_recipe_floor_runs_on_16_bit_weights() -> None:
    w, batch = _mlp_batch()
    oracle = eq.Oracle(w.model, w.loss_fn, "float32", CPU, Recipe("engine", "bf16"))
    assert all(p.dtype == torch.bfloat16 for p in oracle.model_run.parameters())
    state = {k: v.clone() for k, v in w.model.state_dict().items()}
    o, f = oracle.oracle(state, *batch), oracle.floor(state, *batch)
    floor = eq.rel_fro(eq.flat(f, oracle.names), eq.flat(o, oracle.names))
    fp32 = eq.Oracle(w.model, w.loss_fn, "float32", CPU)
    floor32 = eq.rel_fro(eq.flat(fp32.floor(state, *batch), oracle.names), eq.flat(o, oracle.names))
    assert 2.0**-12 < floor < 2.0**-4 and floor > 1e3 * floor32, (floor, floor32)


# -- diagnosis ------------------------------------------------------------------------------------------------
S = 2.0**16


def test_a_loss_scale_never_undone_is_named_with_its_factor() -> None:
    found = _diagnoses(_linear(), lambda o, s, og, sh: {k: v * S for k, v in og.items()}, loss_scale=S)
    assert [d.cause for d in found] == ["loss_scale_not_undone"], found
    assert "65536" in found[0].reason and "unscale_" in found[0].reason


def test_a_loss_scale_undone_twice_is_named_with_its_factor() -> None:
    found = _diagnoses(_linear(), lambda o, s, og, sh: {k: v / S for k, v in og.items()}, loss_scale=S)
    assert [d.cause for d in found] == ["loss_scale_undone_twice"], found
    assert "1/65536" in found[0].reason


def test_a_scale_factor_without_a_loss_scale_is_not_blamed_on_one() -> None:
    found = _diagnoses(_linear(), lambda o, s, og, sh: {k: v * S for k, v in og.items()})
    assert [d.cause for d in found] == ["scaled"], found


def test_a_step_count_is_compared_exactly() -> None:
    fresh: dict = {}
    adam_after_init = {"w": {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3)}}
    both = {"v": {"step": torch.tensor(1.0)}, **adam_after_init}
    assert step_count_mismatch(both, fresh, ["w", "v"]) == (["w", "v"], "w has optimizer step count 1 where 0 was expected")
    assert step_count_mismatch({"w": {"step": torch.tensor(2.0)}}, {"w": {"step": torch.tensor(2.0)}}, ["w"]) is None
    assert step_count_mismatch({"w": {"momentum_buffer": torch.zeros(3)}}, fresh, ["w"]) is None  # SGD: no count


def test_a_16_bit_state_agrees_to_its_own_rounding_and_a_wrong_one_does_not() -> None:
    """A --dtype bfloat16 run's AdamW moments are computed in bfloat16 by the backend and rounded once from float64 by
    the replay: an ulp of each element apart, which is not a different state. A reset moment, a moment of another
    beta, and a float32 moment an ulp of bfloat16 off are."""
    torch.manual_seed(0)
    want = (torch.rand(64, 64, dtype=torch.float64) * 1e-6).to(torch.bfloat16)
    ulp = want.view(torch.int16) + torch.randint(-1, 2, want.shape, dtype=torch.int16)
    have = ulp.view(torch.bfloat16)  # an ulp either way, element by element
    assert not torch.equal(have, want)
    expected = {"w": {"step": torch.tensor(1.0), "exp_avg_sq": want}}
    assert state_difference({"w": {"step": torch.tensor(1.0), "exp_avg_sq": have}}, expected, ["w"]) is None
    for wrong in (torch.zeros_like(want), (want.double() * 10).to(torch.bfloat16)):
        found = state_difference({"w": {"step": torch.tensor(1.0), "exp_avg_sq": wrong}}, expected, ["w"])
        assert found is not None and found[0] == ["w"] and "exp_avg_sq differs" in found[1], found
    as_float32 = {"w": {"step": torch.tensor(1.0), "exp_avg_sq": want.float()}}
    off = {"w": {"step": torch.tensor(1.0), "exp_avg_sq": have.float()}}
    assert state_difference(off, as_float32, ["w"]) is not None  # float32: 1e-4 of its scale, not bfloat16's ulp


# -- real runs ------------------------------------------------------------------------------------------------
def _equivalent(proc, result: dict | None) -> dict:
    assert proc.returncode == 0, proc.output[-6000:]
    assert result is not None
    e = result["equivalence"]
    assert e["verdict"] == "equivalent", (e["first_divergence"], e["notes"])
    for check in ("gradient", "update", "trajectory"):
        c = e["checks"][check]
        assert c["status"] == "pass" and c["noise_ratio"] < 10, (check, c)
    assert e["replicas_identical"] and all(s["grads_identical_across_ranks"] for s in e["per_step"])
    return e


def _different(proc, result: dict | None, check: str, cause: str) -> dict:
    assert proc.returncode == 0, proc.output[-6000:]
    e = result["equivalence"]
    d = e["first_divergence"]
    assert e["verdict"] == "different" and d is not None, e
    assert (d["check"], d["cause"]) == (check, cause), d
    return d


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_bfloat16_weights_with_adamw_are_not_called_different(launch) -> None:
    """The backend's AdamW moments in bfloat16 are an ulp from the replay's rounded ones: the update check holds them
    to bfloat16's rounding, not float32's (before, every such run read `different` at its second step, 'the optimizer
    state before step 1 is not the state step 0 left'). At bfloat16 the checks lack power: `unverifiable`, saying
    so."""
    proc, result = launch("ddp", 2, "mlp", ["--steps", "4", "--measure-steps", "0", "--dtype", "bfloat16",
                                            "--optimizer", "adamw"])
    assert proc.returncode == 0, proc.output[-6000:]
    e = result["equivalence"]
    assert e["first_divergence"] is None, e["first_divergence"]
    assert e["verdict"] == "unverifiable" and "bfloat16" in e["unverifiable_reason"], e["unverifiable_reason"]
    assert e["checks"]["update"]["status"] == "pass", e["checks"]["update"]


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_bf16_autocast_under_ddp_is_equivalent_on_a_floor_of_its_own(launch) -> None:
    proc, result = launch("ddp", 2, "mlp", ["--steps", "2", "--measure-steps", "0", "--amp", "bf16"])
    e = _equivalent(proc, result)
    p = e["precision"]
    assert (p["amp"], p["recipe"], p["wire"], p["loss_scaler"]) == ("bf16", "autocast", "none", None), p
    # the floor is bf16's, measured: far above float32's (~1e-7), below a few bf16 unit roundoffs
    assert 2.0**-12 < e["noise_floor_rel_fro"] < 2.0**-4, e["noise_floor_rel_fro"]
    assert "--amp bf16 autocast recipe" in proc.stdout


@pytest.mark.slow  # breadth: the default tier keeps this capability's other test
@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_deepspeed_bf16_engine_is_judged_on_its_fp32_master_weights(launch, backend) -> None:
    proc, result = launch(backend, 2, "mlp", ["--steps", "2", "--measure-steps", "0", "--amp", "bf16",
                                              "--opt", "amp_recipe=engine"])
    e = _equivalent(proc, result)
    p = e["precision"]
    assert (p["recipe"], p["wire"]) == ("engine", "bf16"), p
    assert e["checks"]["update"]["status"] == "pass" and abs(e["checks"]["update"]["norm_ratio"] - 1) < 0.05
    assert e["tolerance"]["compression"] == "bf16", "the 16-bit all-reduce is in the tolerance"
    assert any(n["code"] == "deepspeed.amp_recipe" and "fp32 master weights" in n["text"] for n in e["notes"])


test_deepspeed_bf16_engine_is_judged_on_its_fp32_master_weights = pytest.mark.parametrize(
    "backend", ["deepspeed"], indirect=True)(test_deepspeed_bf16_engine_is_judged_on_its_fp32_master_weights)


def _cpu_fp16_weights() -> bool:
    """Whether DeepSpeed's CPU accelerator holds fp16 weights here (mkldnn's fp16: a CPU with AVX512-FP16)."""
    try:
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    except ImportError:
        return False
    return bool(CPU_Accelerator.is_fp16_supported(None))


@pytest.mark.slow  # DeepSpeed's fp16 engine, where the CPU runs it: the GPU check's part 2 on a CPU
@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.skipif(not _cpu_fp16_weights(), reason="DeepSpeed's CPU accelerator has no fp16 weights on this CPU "
                                                    "(no AVX512-FP16): its fp16 engine is refused here")
@pytest.mark.parametrize("backend", ["deepspeed"], indirect=True)
@pytest.mark.parametrize("stage", [0, 1])
def test_deepspeed_fp16_engine_where_the_cpu_holds_fp16_weights(launch, backend, stage) -> None:
    """At ZeRO 1 the engine scales its loss, skips the steps that overflow at 2^16 and is `equivalent`; at ZeRO 0
    DeepSpeed 0.19.8 leaves the loss unscaled (deepspeedai/DeepSpeed#8393) and the loss_scale check names it."""
    proc, result = launch(backend, 2, "mlp", ["--measure-steps", "0", "--amp", "fp16", "--opt", "amp_recipe=engine",
                                              "--opt", f"zero_stage={stage}"])
    if stage:
        p = _equivalent(proc, result)["precision"]
        assert p["recipe"] == "engine" and p["skipped_steps"], p  # 2^16 overflows the mlp's fp16 gradients
        return
    from deepspeed.runtime.engine import DeepSpeedEngine

    from dpcompare.adapters.deepspeed_config import stage0_fp16_loss_unscaled

    if stage0_fp16_loss_unscaled(DeepSpeedEngine):
        _different(proc, result, "loss_scale", "overflow_not_seen")
    else:  # a DeepSpeed with the fix
        _equivalent(proc, result)


def _assert_forced_overflow_skipped(proc, result) -> list[int]:
    e = _equivalent(proc, result)
    p = e["precision"]
    steps = p["steps"]
    assert steps[0]["step"] == 0 and steps[0]["scale"] == 2.0**24 and steps[0]["predicted_overflow"], steps[0]
    for s in steps:
        assert s["ok"] and s["predicted_overflow"] == s["reduced_non_finite"] == s["skipped"], s
        assert s["scale_after"] == (s["scale"] / 2 if s["skipped"] else s["scale"]), s
    assert p["skipped_steps"][0] == 0 and e["checked_steps"], "a later step must be checked against the oracle"
    assert f"step(s) {', '.join(map(str, p['skipped_steps']))} skipped on overflow" in proc.stdout
    return p["skipped_steps"]


@pytest.mark.slow  # the default tier keeps this capability in a sibling test
@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["horovod"], indirect=True)
def test_a_forced_fp16_overflow_is_skipped_where_the_ranks_overflow(launch, backend) -> None:
    proc, result = launch(backend, 2, "mlp", ["--steps", "8", "--measure-steps", "0", *FORCED])
    _assert_forced_overflow_skipped(proc, result)


@pytest.mark.slow  # breadth: the default tier keeps this capability's other test
@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_a_loss_scale_never_undone_is_different_naming_the_factor(launch) -> None:
    proc, result = launch("tests.faulty_adapters:NeverUnscaledDDP", 2, "mlp",
                          ["--steps", "2", "--measure-steps", "0", "--amp", "fp16"], launcher="torchrun")
    d = _different(proc, result, "gradient", "loss_scale_not_undone")
    assert d["step"] == 0 and "loss scale 65536" in d["reason"], d


# -- slow: the breadth -------------------------------------------------------------------------------------------
MATRIX = [(b, a, m) for b in ("reference", "dp", "ddp", "horovod", "deepspeed") for a in ("bf16", "fp16")
          for m in ("mlp", "gpt-tiny") if not (b == "ddp" and a == "bf16" and m == "mlp")]


def _matrix_tier(backend: str, model: str):
    """dp on CPU is reference's pass-through, and Horovod's and DeepSpeed's gpt-tiny cells repeat their mlp's recipe
    on a model ddp covers: the deep tier."""
    return pytest.mark.deep if backend == "dp" or (backend in ("horovod", "deepspeed") and model == "gpt-tiny") \
        else pytest.mark.slow


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("backend", "amp", "model"), [pytest.param(b, a, m, marks=_matrix_tier(b, m)) for b, a, m in MATRIX],
                         indirect=["backend"])
def test_every_backend_recipe_and_model_is_equivalent(launch, backend, amp, model, record_noise_ratio) -> None:
    ws = 1 if backend in ("reference", "dp") else 2
    proc, result = launch(backend, ws, model, ["--steps", "2", "--measure-steps", "0", "--amp", amp])
    e = _equivalent(proc, result)
    record_noise_ratio(result)
    assert e["precision"]["recipe"] == "autocast" and e["precision"]["amp"] == amp
    assert (e["precision"]["loss_scaler"] is not None) == (amp == "fp16")


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["deepspeed"], indirect=True)
@pytest.mark.parametrize("extra", [["--model", "lm"], ["--grad-accum", "2"]], ids=["lm", "grad-accum-2"])
def test_deepspeed_bf16_engine_breadth(launch, backend, extra) -> None:
    model = extra[1] if extra[0] == "--model" else "mlp"
    rest = [] if extra[0] == "--model" else extra
    proc, result = launch(backend, 2, model, ["--steps", "2", "--measure-steps", "0", "--amp", "bf16",
                                              "--opt", "amp_recipe=engine", *rest])
    assert _equivalent(proc, result)["precision"]["recipe"] == "engine"


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["deepspeed"], indirect=True)
def test_deepspeed_bf16_engine_with_batchnorm_casts_its_buffers_or_is_refused(launch, backend) -> None:
    """DeepSpeed casts the weights to 16 bits and keeps buffers in float32, which BatchNorm cannot mix: refused in one
    line before the run; with --opt buffer_dtype=amp (its data_types.buffer_dtype) it runs and is judged."""
    args = ["--steps", "2", "--measure-steps", "0", "--amp", "bf16", "--opt", "amp_recipe=engine"]
    proc, result = launch(backend, 2, "cnn", args)
    assert proc.returncode != 0 and result is None
    assert "add --opt buffer_dtype=amp" in proc.stderr and "Traceback" not in proc.stderr.split("dpcompare: error")[0]
    proc, result = launch(backend, 2, "cnn", [*args, "--opt", "buffer_dtype=amp"])
    e = _equivalent(proc, result)
    assert e["batchnorm"]["semantics"] == "per_replica" and all(not b["ranks_agree"] for b in e["buffers"]
                                                                if b["name"].endswith("running_mean"))


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_fp16_with_gradient_accumulation_is_equivalent(launch) -> None:
    proc, result = launch("ddp", 2, "lm", ["--steps", "2", "--measure-steps", "0", "--amp", "fp16", "--grad-accum", "2"])
    _equivalent(proc, result)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(600)
@pytest.mark.parametrize("backends", [("reference", "ddp", "horovod", "deepspeed")])
def test_every_backend_skips_the_same_steps(launch, backends) -> None:
    """The same forced overflow under every backend: each skips exactly where the oracle's emulation of its ranks
    overflows, and backends of the same world size skip the same steps."""
    skipped = {}
    for backend in backends:
        ws = 1 if backend == "reference" else 2
        proc, result = launch(backend, ws, "mlp", ["--steps", "8", "--measure-steps", "0", *FORCED])
        skipped[backend] = (ws, _assert_forced_overflow_skipped(proc, result))
    at_two = {tuple(s) for ws, s in skipped.values() if ws == 2}
    assert len(at_two) == 1, skipped


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("adapter", "extra", "check", "cause", "step"), [
    ("UnscaledTwiceDDP", ["--amp", "fp16"], "gradient", "loss_scale_undone_twice", 0),
    ("SteppingOnInfDDP", FORCED, "loss_scale", "stepped_on_overflow", 0),
    ("SkipSecondStepDDP", ["--amp", "fp16"], "update", "skipped_step", 1),
    ("NotScalingDDP", FORCED, "loss_scale", "overflow_not_seen", 0),
], ids=["unscaled-twice", "stepping-on-inf", "skipping-a-finite-step", "loss-never-scaled"])
def test_planted_loss_scaling_faults_are_different(launch, adapter, extra, check, cause, step) -> None:
    proc, result = launch(f"tests.faulty_adapters:{adapter}", 2, "mlp", ["--steps", "2", "--measure-steps", "0", *extra],
                          launcher="torchrun")
    d = _different(proc, result, check, cause)
    assert d["step"] == step, d


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_unchecked_steps_follow_the_backends_own_skips(launch) -> None:
    """With --check-every 3 the overflowing steps between checks are not judged, but the reference trajectory must
    skip them as the backend did (else it walks away and the trajectory fails on a correct run); the result counts
    them."""
    proc, result = launch("ddp", 2, "mlp", ["--steps", "10", "--check-every", "3", "--measure-steps", "0", *FORCED])
    e = _equivalent(proc, result)
    p = e["precision"]
    assert p["skipped_steps"] == [0, 3, 6] and p["skipped_total"] == 7, p
    assert "(7 in all, unchecked steps counted)" in proc.stdout


@pytest.mark.parametrize("kind", ["engine", "autocast"])
def test_the_reference_trajectory_runs_its_recipe_copy_at_the_steps_loss_scale(kind: str) -> None:
    """The run-recipe copy of the reference trajectory scales its loss as the backend's step did: at a scale its
    fp16 gradients overflow, its own loss scaler skips the step (the float64 copy steps); at scale 1 it steps. A copy
    that ignored the scale would step both times."""
    from dpcompare.verify.trajectory.reference_trajectory import Trajectory

    torch.manual_seed(0)
    template = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    pieces = [eq.Piece(torch.randn(4, 6), torch.randint(0, 3, (4,)), 1.0)]
    moved = {}
    for scale in (2.0**40, 1.0):
        trajectory = Trajectory(template, nn.functional.cross_entropy,
                                lambda params, **_: torch.optim.SGD(params, lr=0.1), "float32", torch.device("cpu"),
                                depth=2, recipe=Recipe(kind, "fp16"))
        before = [p.detach().clone() for p in trajectory.model_run.parameters()]
        with trajectory.whole():
            before64 = [p.detach().clone() for p in trajectory.model64.parameters()]
        trajectory.step(pieces, loss_scale=scale)
        with trajectory.whole():
            moved[scale] = (any(not torch.equal(p, b) for p, b in zip(trajectory.model_run.parameters(), before)),
                            any(not torch.equal(p, b) for p, b in zip(trajectory.model64.parameters(), before64)))
    assert moved[2.0**40] == (False, True), moved
    assert moved[1.0] == (True, True), moved
