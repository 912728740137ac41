"""The adapter contract and the layers: declared options, the settings every backend shares, native counters'
arithmetic, instrumentation that really switches the backends' own timers off, and the import rule that a
rank of a run never loads a command module.

Each check has its negative twin: an unknown or mistyped option is refused, a counter with nothing to show
gives a reason instead of a figure, a planted import of a command module is caught by the layering scan.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dpcompare.contract import Adapter, CommCounts, Option, Settings
from dpcompare.measure.clocks import IntervalClock
from dpcompare.measure.comm import figures
from dpcompare.run import backend, registry
from dpcompare.run.config import RunConfig
from dpcompare.contract.launch_env import LaunchEnv

REPO = Path(__file__).resolve().parents[1]
ONE = LaunchEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, launcher="python", job_id="test")


def adapter_class(name: str) -> type[Adapter]:
    return registry.load(name, registry.BACKENDS, "backend")


# -- declared options --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(registry.BACKENDS))
def test_every_adapter_declares_typed_options_and_native_names_that_point_at_run_settings(name):
    cls = adapter_class(name)
    run_fields = {f for f in RunConfig.__dataclass_fields__}
    for option in cls.OPTIONS:
        assert isinstance(option, Option) and option.meaning and option.type in (bool, int, float, str)
        assert option.name not in run_fields, f"{option.name} is a run setting, not an adapter option"
        assert option.parse(option.default) == option.default
    assert set(cls.NATIVE_NAMES.values()) <= run_fields
    caps = cls.capabilities
    assert caps.native_launcher in caps.launchers
    assert caps.shards in {"none", "optimizer", "gradients", "parameters"}
    assert _bad_variants(cls) == []


def _bad_variants(cls: type[Adapter]) -> list[str]:
    """The variants (compare --backends NAME:VARIANT passes their values as --opt) that are not declared options
    with values those options accept."""
    declared = {o.name: o for o in cls.OPTIONS}
    bad = []
    for variant, values in cls.VARIANTS.items():
        for key, value in values.items():
            try:
                ok = key in declared and declared[key].parse(value) == value
            except ValueError:
                ok = False
            if not ok or not variant or ":" in variant:
                bad.append(f"{variant}: {key}={value!r}")
    return bad


def test_a_variant_naming_an_undeclared_option_or_value_is_caught():
    """The twin of the variant check above."""
    class Bad(Adapter):
        OPTIONS = (Option("zero_stage", int, 0, "a stage", choices=(0, 1)),)
        VARIANTS = {"zero1": {"zero_stage": 1}, "zero2": {"zero_stage": 2}, "typo": {"zero_stag": 1}}

    assert _bad_variants(Bad) == ["zero2: zero_stage=2", "typo: zero_stag=1"]


def test_a_deepspeed_stage_declares_what_it_shards_per_instance():
    cls = adapter_class("deepspeed")
    for stage, shards in enumerate(("none", "optimizer", "gradients", "parameters")):
        settings = backend.settings_for(cls, RunConfig(backend="deepspeed", options={"zero_stage": str(stage)}))
        adapter = cls(ONE, torch.device("cpu"), settings)
        assert adapter.capabilities.shards == shards
        assert adapter.capabilities.can_disable_sync == (stage < 2), "ZeRO-2/3 reduce every micro-batch"
    assert cls.capabilities.shards == "none", "the class keeps the default's declaration"


def test_declared_options_are_typed_and_defaulted():
    cfg = RunConfig(backend="ddp", options={"gradient_as_bucket_view": "true"})
    settings = backend.settings_for(adapter_class("ddp"), cfg)
    assert settings.options == {"dist_backend": "auto", "gradient_as_bucket_view": True, "broadcast_buffers": True,
                                "find_unused_parameters": "auto"}
    # From Python an option may already be typed.
    typed = backend.settings_for(adapter_class("deepspeed"), RunConfig(backend="deepspeed", options={"gradient_clipping": 1.0}))
    assert typed.options == {"dist_backend": "auto", "gradient_clipping": 1.0, "amp_recipe": "autocast",
                             "buffer_dtype": "keep", "zero_stage": 0, "param_persistence_threshold": 0}


@pytest.mark.parametrize(("name", "options", "expected"), [
    pytest.param("ddp", {"foo": "1"}, ["--opt foo=1 is not an option of --backend ddp", "gradient_as_bucket_view (true/false",
                                       "broadcast_buffers"], id="unknown-key-lists-accepted"),
    pytest.param("reference", {"foo": "1"}, ["takes no --opt options"], id="no-options"),
    pytest.param("ddp", {"compression": "fp16"}, ["is a run setting", "use --compression fp16"], id="run-setting"),
    pytest.param("horovod", {"compression": "bf16"}, ["is a run setting", "use --compression bf16"], id="horovod-bf16"),
    pytest.param("ddp", {"dp_devices": "2"}, ["is a run setting", "use --dp-devices 2"], id="dp-devices-as-opt"),
    pytest.param("ddp", {"bucket_cap_mb": "25"}, ["ddp's own name for --bucket-mb"], id="ddp-bucket-cap-mb"),
    pytest.param("deepspeed", {"communication_data_type": "fp16"}, ["deepspeed's own name for --compression"],
                 id="deepspeed-communication-data-type"),
    pytest.param("horovod", {"broadcast_optimizer_state": "sometimes"}, ["is invalid", "true/false"], id="bad-bool"),
    pytest.param("deepspeed", {"gradient_clipping": "high"}, ["is invalid", "a number"], id="bad-float"),
    pytest.param("deepspeed", {"amp_recipe": "fused"}, ["--opt amp_recipe='fused' is invalid", "autocast, engine"], id="bad-choice"),
])
def test_bad_options_are_refused_with_one_line(name, options, expected):
    with pytest.raises(ValueError) as info:
        backend.settings_for(adapter_class(name), RunConfig(backend=name, options=options))
    message = str(info.value)
    assert "\n" not in message
    for text in expected:
        assert text in message, message


def test_settings_every_backend_shares_are_checked_once_and_reach_the_adapter():
    cfg = RunConfig(backend="ddp", compression="bf16", bucket_mb=0.5, instrument=False)
    settings = backend.settings_for(adapter_class("ddp"), cfg)
    assert (settings.compression, settings.bucket_mb, settings.instrument) == ("bf16", 0.5, False)
    with pytest.raises(ValueError, match="not available for --backend horovod"):
        backend.settings_for(adapter_class("horovod"), replace(cfg, backend="horovod"))
    # dp_devices reaches the dp adapter from a config built in Python (no CLI copying it anywhere).
    dp = backend.settings_for(adapter_class("dp"), RunConfig(backend="dp", dp_devices=3))
    assert dp.dp_devices == 3
    assert adapter_class("dp")(ONE, torch.device("cpu"), dp).settings.dp_devices == 3
    with pytest.raises(ValueError, match="does not apply to --backend ddp"):
        backend.settings_for(adapter_class("ddp"), RunConfig(backend="ddp", dp_devices=3))


def test_compression_is_judged_with_the_wire_tolerance_only_through_the_run_setting():
    """`--opt compression=fp16` can no longer reach an adapter behind the tolerance's back: it is refused,
    so the only way to compress is --compression, which the tolerance reads."""
    from dpcompare.verify.oracle import gradient_oracle as eq

    with pytest.raises(ValueError):
        backend.settings_for(adapter_class("ddp"), RunConfig(backend="ddp", options={"compression": "fp16"}))
    assert eq.wire_roundoff("float32", "fp16") > eq.wire_roundoff("float32", "none")


# -- native counters: the arithmetic lives in measurement -------------------------------------------------
def test_counts_become_milliseconds_per_window():
    clock = IntervalClock(torch.device("cpu"))
    per_step = figures(CommCounts(method="m", unit_s=1e-9, per_step_total=(2e6, 4e6), per_step_overlap=(1e6, 1e6)), clock, 2)
    assert per_step["per_step_total_ms"] == pytest.approx([2.0, 4.0])
    assert (per_step["total_ms"], per_step["overlap_ms"]) == pytest.approx((6.0, 2.0))
    window = figures(CommCounts(method="w", window_total=7.5), clock, 3)
    assert window == {"method": "w", "steps": 3, "overlap_ms": None, "total_ms": 7.5}
    with clock.interval():
        sum(range(10000))
    timed = figures(CommCounts(method="t", timed_intervals=True), clock, 1)
    assert timed["total_ms"] > 0 and timed["total_ms"] == clock.total_ms()


def test_counts_with_nothing_to_show_give_a_reason_not_a_zero(tmp_path):
    clock = IntervalClock(torch.device("cpu"))
    assert figures(CommCounts(reason="rank 1 keeps no timeline"), clock, 2) == {"reason": "rank 1 keeps no timeline"}
    assert "returned no figure" in figures(CommCounts(method="empty"), clock, 2)["reason"]
    broken = tmp_path / "timeline.json"
    broken.write_text("[{not json")
    out = figures(CommCounts(method="h", timeline=str(broken)), clock, 2)
    assert "cannot read the Horovod timeline" in out["reason"] and not broken.exists()


def test_horovod_timeline_is_read_and_removed_by_measurement(tmp_path):
    path = tmp_path / "timeline.json"
    events = [{"ph": "B", "pid": 1, "name": "ALLREDUCE", "ts": 0}, {"ph": "E", "pid": 1, "ts": 1500},
              {"ph": "B", "pid": 2, "name": "ALLREDUCE", "ts": 1000}, {"ph": "E", "pid": 2, "ts": 2000}]
    path.write_text(json.dumps(events)[:-1] + ",")  # Horovod leaves the array open while it writes
    out = figures(CommCounts(method="h", timeline=str(path)), IntervalClock(torch.device("cpu")), 1)
    assert out["total_ms"] == pytest.approx(2.0) and not path.exists()


ONE_RANK_ADAPTER = """
import os, sys, torch
from dpcompare.contract import Settings
from dpcompare.run import registry
from dpcompare.contract.launch_env import LaunchEnv
env = LaunchEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, launcher="python", job_id="t")
cls = registry.load(sys.argv[1], registry.BACKENDS, "backend")
adapter = cls(env, torch.device("cpu"), Settings(instrument=sys.argv[2] == "on",
                                                 options={o.name: o.default for o in cls.OPTIONS}))
adapter.setup(60)
model = torch.nn.Linear(4, 2)
wrapped = adapter.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), 2, 2)
for i in range(14):
    adapter.backward(wrapped.model(torch.ones(2, 4)).sum())
    adapter.reduce(); adapter.step(); adapter.zero_grad()
"""

PROBES = {
    # DDP records every iteration only when instrumented (default sampling: the first 10, then every 100th).
    "ddp": "print(int(wrapped.model._get_ddp_logging_data().get('iteration', 0)))",
    # DeepSpeed's synchronising timers are on only when instrumented.
    "deepspeed": "print(int(wrapped.model.wall_clock_breakdown()))",
    # Horovod's timeline (HOROVOD_TIMELINE=DYNAMIC at init) is decided by timeline_off_reason: "not instrumented"
    # under --no-instrument, and never set then; in one process it is off for another reason (nothing to record).
    "horovod": "print(int(adapter._timeline_off != 'not instrumented' or 'HOROVOD_TIMELINE' in os.environ))",
}


def _probe(name: str, instrument: str, tmp_path: Path) -> int:
    code = ONE_RANK_ADAPTER + PROBES[name] + "\nadapter.teardown()\nsys.stdout.flush(); os._exit(0)\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
    out = subprocess.run([sys.executable, "-c", code, name, instrument], capture_output=True, text=True, timeout=240,
                         cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.multiproc
@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend_name", [pytest.param("ddp", marks=pytest.mark.slow),
                                          pytest.param("horovod", marks=pytest.mark.slow),
                                          pytest.param("deepspeed", marks=pytest.mark.deep)], indirect=False)
def test_no_instrument_switches_the_backends_own_timers_off(backend_name, tmp_path):
    """Under --no-instrument the backend's own counters cost the step nothing: DDP keeps its default logging
    sampling, DeepSpeed's timers and Horovod's dynamic timeline stay off. Instrumented, they are on."""
    from conftest import BACKEND_MODULES

    module = BACKEND_MODULES.get(backend_name)
    if module is not None and importlib.util.find_spec(module) is None:
        pytest.skip(f"{backend_name} is not installed")
    on, off = _probe(backend_name, "on", tmp_path), _probe(backend_name, "off", tmp_path)
    if backend_name == "ddp":
        assert on >= 13 and off <= 10, (on, off)
    else:
        assert (on, off) == (1, 0)


# -- layers (the import contracts: tests/test_layers.py) ----------------------------------------------------
def test_a_rank_imports_no_command_module():
    """Importing the trainer and everything a rank loads (every built-in adapter class) loads no command module."""
    code = ("import sys, dpcompare.run.trainer, dpcompare.run.registry as r\n"
            "[r.load(b, r.BACKENDS, 'backend') for b in r.BACKENDS]\n"
            "print([m for m in sys.modules if m.startswith('dpcompare.commands') or m == 'dpcompare.cli'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_settings_default_to_declared_options():
    cls = adapter_class("horovod")
    adapter = cls(ONE, torch.device("cpu"))
    assert adapter.settings == Settings(options={"timeline": "auto", "broadcast_optimizer_state": False})


def test_a_run_is_named_after_the_variant_its_options_make():
    cls = adapter_class("deepspeed")
    options = lambda **kw: backend.settings_for(cls, RunConfig(backend="deepspeed", options=kw)).options  # noqa: E731
    assert backend.variant_name(cls, options(zero_stage="2")) == "zero2"
    assert backend.variant_name(cls, options()) == "", "the defaults make no variant (zero0 is the baseline)"
    assert backend.variant_name(adapter_class("ddp"), {}) == ""


def test_horovod_timeline_auto_needs_two_cores_per_local_rank():
    """Horovod's timeline writer spins on a core once HOROVOD_TIMELINE is set: auto keeps it off where the local
    ranks have no spare core, and says so with the way to turn it on; on and off are obeyed; never without
    instrumentation."""
    from dpcompare.adapters.horovod import timeline_off_reason

    assert timeline_off_reason("auto", True, cores=16, local_ranks=8, world_size=2) is None
    assert timeline_off_reason("auto", True, cores=2, local_ranks=1, world_size=2) is None
    off = timeline_off_reason("auto", True, cores=2, local_ranks=2, world_size=2)
    assert off is not None and "2 core(s) for 2 local rank(s)" in off and "--opt timeline=on" in off
    assert timeline_off_reason("on", True, cores=2, local_ranks=2, world_size=2) is None
    assert timeline_off_reason("off", True, cores=64, local_ranks=1, world_size=2) is not None
    assert timeline_off_reason("on", False, cores=64, local_ranks=1, world_size=2) == "not instrumented"
    assert timeline_off_reason("on", True, cores=64, local_ranks=1, world_size=1) is not None  # nothing to record


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_horovod_timeline_is_the_counter_when_on_and_its_reason_is_said_when_off(launch):
    """A real two-rank Horovod run: with --opt timeline=on the timeline is the native counter (total communication
    from its ALLREDUCE intervals); with timeline=off the total is n/a with the reason, and the exposed figure is
    still measured by the ablation."""
    if importlib.util.find_spec("horovod") is None:
        pytest.skip("horovod is not installed")
    common = ["--steps", "1", "--check-every", "0", "--warmup-steps", "1", "--measure-steps", "5"]
    _, on = launch("horovod", 2, "mlp", [*common, "--opt", "timeline=on"])
    assert on is not None and on["metrics"]["comm_total_ms"] > 0
    assert on["metrics"]["comm_total_method"].startswith("Horovod timeline")
    _, off = launch("horovod", 2, "mlp", [*common, "--opt", "timeline=off"])
    assert off is not None and off["metrics"]["comm_total_ms"] is None
    assert "timeline is off (--opt timeline=off)" in off["metrics"]["reasons"]["comm_total_ms"]
    assert off["metrics"]["comm_exposed_ms"] is not None


def test_an_empty_backend_is_refused_naming_every_registered_one():
    with pytest.raises(ValueError) as refused:
        RunConfig(backend="").validate()
    named = str(refused.value).split("(")[-1].split(")")[0].split(", ")
    assert named == list(registry.BACKENDS), str(refused.value)
