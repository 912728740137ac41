"""dpcompare convert: checkpoints carried between DeepSpeed ZeRO 1-3, DCP and torch with their whole state.

- In-process (default tier): a torch checkpoint of get_state_dict's state, with two parameter groups, carried to DCP,
  to a universal checkpoint and back, every part bitwise; the comparison itself fails on a changed moment, a dropped
  one and a changed hyper-parameter; each bad input (not a checkpoint, a partial ZeRO checkpoint, a name that matches no
  parameter, DST not empty, a format mismatch, a state the target cannot hold) is one line with exit status 2, nothing
  written and DST untouched.
- Real runs (breadth tier): ZeRO-2 and ZeRO-3 checkpoints saved by DeepSpeed's engine at two ranks, read bitwise as
  the engine's state was read through the adapter contract; the twin converters that zero the second moment or match
  the moments by shape instead of name are caught by the load's check, naming the parameters they touched.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import Launcher, child_env, run_command
from dpcompare.commands.convert import convert
from dpcompare.commands.convert import torch_formats as tf
from dpcompare.commands.convert.deepspeed_formats import read_universal
from dpcompare.commands.convert.portable import Portable, Refused, differences

pytest.importorskip("deepspeed")


def _trained(groups: int = 2, sgd: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    params = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}] if groups == 2 \
        else list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9) if sgd else torch.optim.AdamW(params, lr=1e-2)
    for _ in range(3):
        model(torch.randn(4, 6)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _torch_checkpoint(where: Path, **kw) -> Path:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model, opt = _trained(**kw)
    model_sd, optim_sd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    where.mkdir(parents=True)
    torch.save({"model": model_sd, "optim": optim_sd}, where / tf.TORCH_FILE)
    return where


def test_a_torch_checkpoint_goes_to_dcp_and_deepspeed_and_back_bitwise(tmp_path):
    src = _torch_checkpoint(tmp_path / "src")
    read = tf.read_torch(src)
    assert len(read.groups) == 2 and read.groups[0]["weight_decay"] == 0.1 and read.groups[0]["params"] == [
        "0.weight", "2.weight", "4.weight"]
    for to, reader in (("dcp", tf.read_dcp), ("torch", tf.read_torch),
                       ("deepspeed", lambda d: read_universal(d, None))):
        dst = tmp_path / f"to-{to}"
        _, lost, _, apart = convert(src, dst, to, check=True)
        assert lost == [] and apart == [], (to, apart)
        back = reader(dst)
        parts = ("weights", "buffers", "optimizer", "groups", "scheduler")
        assert differences(read, back, parts) == [], to  # every part, bitwise, read by a fresh reader
        # DeepSpeed's engine keeps a step counter torch has no place for: derived from the optimizer's step count
        assert back.counters == ({"global_steps": 3, "skipped_steps": 0} if to == "deepspeed" else {})
        again = tmp_path / f"back-from-{to}"
        convert(dst, again, "torch", check=True)
        assert differences(read, tf.read_torch(again), parts) == [], to
    # the universal checkpoint holds what both ZeRO families open, and its tag
    tagged = tmp_path / "to-deepspeed"
    tag = (tagged / "latest_universal").read_text()
    assert (tagged / tag / "mp_rank_00_model_states.pt").is_file()
    assert (tagged / tag / "zero_pp_rank_0_mp_rank_00_model_states.pt").is_file()
    assert tag == "global_step3"


def test_the_comparison_names_a_changed_moment_a_dropped_one_and_a_changed_group():
    model, opt = _trained()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    base = tf.from_state({"model": model_sd, "optim": optim_sd}, "test")
    assert differences(base, tf.from_state(tf.to_state(base), "again")) == []
    for change, expected in (
            (lambda s: _one_ulp(s["optim"]["state"]["2.weight"]["exp_avg"]), "optimizer 2.weight.exp_avg: 1 of 64"),
            (lambda s: s["optim"]["state"]["4.bias"].pop("exp_avg_sq"), "optimizer 4.bias.exp_avg_sq: missing"),
            (lambda s: s["optim"]["param_groups"][1].update(lr=0.5), "groups 1.lr"),
            (lambda s: s["model"]["0.weight"].view(-1)[0].neg_(), "weights 0.weight")):
        state = tf.to_state(base)
        state = {"model": {k: v.clone() for k, v in state["model"].items()},
                 "optim": {"state": {n: {k: v.clone() for k, v in s.items()} for n, s in state["optim"]["state"].items()},
                           "param_groups": [dict(g) for g in state["optim"]["param_groups"]]}}
        change(state)
        found = differences(base, tf.from_state(state, "changed"))
        assert len(found) == 1 and found[0].startswith(expected), found


def _one_ulp(t: torch.Tensor) -> None:
    """One element of `t` moved to the next float: the smallest change a comparison must see."""
    flat = t.view(-1)
    flat[3] = torch.nextafter(flat[3], torch.tensor(float("inf")))


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -m dpcompare convert ARGS`, in this process (dpcompare.cli.main, as __main__ calls it): its exit status
    and what it printed. One test runs it as a process too (test_the_command_line_refuses_without_a_traceback)."""
    import contextlib
    import io

    from dpcompare import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(["convert", *args])
    return subprocess.CompletedProcess(args, status, out.getvalue(), err.getvalue())


def test_the_command_line_refuses_without_a_traceback(tmp_path):
    done = subprocess.run([sys.executable, "-m", "dpcompare", "convert", str(tmp_path / "none"), str(tmp_path / "o"),
                           "--to", "dcp"], check=False, cwd=tmp_path, capture_output=True, text=True, env=child_env(tmp_path),
                          timeout=120)
    _one_line_refusal(done, "no such file or directory")
    assert not (tmp_path / "o").exists()


def _one_line_refusal(done: subprocess.CompletedProcess, expected: str) -> None:
    assert done.returncode == 2, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.strip() and "[WARNING]" not in ln]
    assert len(lines) == 1 and lines[0].startswith("dpcompare convert: error:") and expected in lines[0], lines
    assert "Traceback" not in done.stderr


def test_bad_input_is_one_line_with_exit_status_2_and_nothing_written(tmp_path):
    src = _torch_checkpoint(tmp_path / "src")
    (tmp_path / "empty").mkdir()
    _one_line_refusal(_cli(str(tmp_path / "empty"), str(tmp_path / "out1"), "--to", "dcp", cwd=tmp_path),
                      "not a checkpoint convert reads")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    _one_line_refusal(_cli(str(src), str(full), "--to", "dcp", cwd=tmp_path), "not empty")
    assert [f.name for f in full.iterdir()] == ["keep.txt"] and (full / "keep.txt").read_text() == "mine"
    _one_line_refusal(_cli(str(src), str(tmp_path / "out2"), "--to", "dcp", "--from", "dcp", cwd=tmp_path),
                      "--from dcp, but its files are a torch checkpoint's")
    # a name in the optimizer that matches no parameter
    state = torch.load(src / tf.TORCH_FILE, weights_only=False)
    state["optim"]["state"]["encoder.gone"] = state["optim"]["state"].pop("4.bias")
    stray = tmp_path / "stray"
    stray.mkdir()
    torch.save(state, stray / tf.TORCH_FILE)
    _one_line_refusal(_cli(str(stray), str(tmp_path / "out3"), "--to", "dcp", cwd=tmp_path),
                      "'encoder.gone'")
    # a partial ZeRO checkpoint: rank 1's optimizer file missing
    partial = tmp_path / "partial" / "global_step2"
    partial.mkdir(parents=True)
    (tmp_path / "partial" / "latest").write_text("global_step2")
    torch.save({"optimizer_state_dict": {"zero_stage": 2, "partition_count": [2]}},
               partial / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    torch.save({}, partial / "mp_rank_00_model_states.pt")
    _one_line_refusal(_cli(str(tmp_path / "partial"), str(tmp_path / "out4"), "--to", "torch", cwd=tmp_path),
                      "zero_pp_rank_1_mp_rank_00_optim_states.pt is not")
    # a state the target cannot hold: buffers into DeepSpeed's universal load
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters())
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    bn = tmp_path / "bn"
    bn.mkdir()
    torch.save({"model": msd, "optim": osd}, bn / tf.TORCH_FILE)
    _one_line_refusal(_cli(str(bn), str(tmp_path / "out5"), "--to", "deepspeed", cwd=tmp_path), "buffers")
    assert not any((tmp_path / f"out{i}").exists() for i in range(1, 6))
    assert not [f for f in tmp_path.iterdir() if ".part-" in f.name]  # no half-written directory left
    done = _cli(str(bn), str(tmp_path / "out6"), "--to", "deepspeed", "--allow-lossy", cwd=tmp_path)
    assert done.returncode == 0 and "not carried (--allow-lossy): the module's 3 buffers" in done.stdout, done.stdout


def test_zero3_is_told_what_its_loader_would_not_restore(tmp_path):
    src = _torch_checkpoint(tmp_path / "src", sgd=True)
    with pytest.raises(Refused, match="ZeRO-3's universal loader reads Adam's"):
        convert(src, tmp_path / "z3", "deepspeed", zero_stage=3)
    done = _cli(str(src), str(tmp_path / "any"), "--to", "deepspeed", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "not loaded by ZeRO-3: the optimizer state momentum_buffer" in done.stdout, done.stdout
    assert "bitwise the state read" in done.stdout


# -- real DeepSpeed checkpoints ---------------------------------------------------------------------------------------
RUN = ["--optimizer", "adamw", "--steps", "2", "--global-batch", "32", "--measure-steps", "0"]


@pytest.fixture(scope="module")
def saved_zero(tmp_path_factory):
    """A ZeRO-2 and a ZeRO-3 checkpoint, each saved by DeepSpeed's engine at two ranks after 2 AdamW steps."""
    made = {}

    def get(stage: int) -> Path:
        if stage not in made:
            where = tmp_path_factory.mktemp(f"zero{stage}")
            proc, result = Launcher(where)("deepspeed", 2, "mlp-dropout", [*RUN, "--opt", f"zero_stage={stage}",
                                                                         "--save-checkpoint", str(where / "saved")])
            assert result is not None, proc.output[-3000:]
            made[stage] = where / "saved"
        return made[stage]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_a_zero_checkpoint_saved_by_the_engine_is_read_as_the_contract_read_it(tmp_path, saved_zero, stage):
    saved = saved_zero(stage)
    contract = torch.load(saved / "dpcompare-saved.pt", weights_only=False)
    for to in ("torch", "dcp"):
        p, lost, _, apart = convert(saved, tmp_path / to, to, check=True)
        assert apart == [] and lost == []
        assert p.source.startswith(f"DeepSpeed ZeRO-{stage} checkpoint of 2 ranks")
        back = (tf.read_torch if to == "torch" else tf.read_dcp)(tmp_path / to)
        expected = Portable(params=contract["params"], optimizer=contract["optimizer"])
        assert differences(expected, back, ("weights", "optimizer")) == []
        assert back.counters["global_steps"] == 2 and back.scaler is not None
        steps = [s["step"] for s in p.optimizer.values()]
        assert len({id(t) for t in steps}) == len(steps)  # each its own count (ZeRO-3 keeps one a group)


@pytest.mark.slow
@pytest.mark.parametrize("planted, touched", [("drop-exp-avg-sq", None), ("swap-moments", ["0.bias", "3.bias"])])
def test_a_twin_converter_is_caught_by_the_load_naming_what_it_touched(tmp_path, saved_zero, planted, touched):
    saved, converted = saved_zero(2), tmp_path / "converted"
    done = run_command([sys.executable, "-m", "dpcompare", "convert", str(saved), str(converted), "--to", "torch",
                        "--plant", planted], cwd=tmp_path, env=child_env(tmp_path), timeout_s=300)
    assert done.returncode == 0 and "bitwise the state read" in done.output, done.output[-2000:]  # it agrees with itself
    for name in ("dpcompare-loop.pt", "dpcompare-saved.pt"):
        (converted / name).write_bytes((saved / name).read_bytes())
    proc, result = Launcher(tmp_path)("ddp", 1, "mlp-dropout", [*RUN, "--checkpoint-format", "torch",
                                                                "--load-checkpoint", str(converted)])
    assert result is not None, proc.output[-3000:]
    eq = result["equivalence"]
    assert eq["verdict"] == "different" and eq["first_divergence"]["cause"] == "checkpoint_optimizer", eq
    assert eq["checkpoint"]["loaded"]["parts"]["optimizer"] == "differs"
    assert eq["checkpoint"]["loaded"]["parts"]["parameters"].startswith("bitwise equal")
    names = eq["first_divergence"]["parameters"]
    expected = touched or ["0.bias", "0.weight", "3.bias", "3.weight", "6.bias", "6.weight"]
    assert sorted(names) == expected, names


@pytest.mark.slow
def test_a_transformers_llama_moves_between_zero2_zero3_and_fsdp2_both_ways(tmp_path):
    """A Llama-style hf: config trained under DeepSpeed ZeRO-2 and ZeRO-3 with AdamW, saved by the engine, converted to
    DCP and loaded into FSDP2 at another world size; and FSDP2's DCP checkpoint into ZeRO-2 and ZeRO-3: each loaded
    state bitwise the saved, each continuation `equivalent` to the uninterrupted run."""
    import json

    import transformers

    transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=256, max_position_embeddings=64
                             ).save_pretrained(tmp_path / "tiny-llama")
    out = tmp_path / "moves"
    cells = "zero2:2>fsdp:1,zero3:2>fsdp:1,fsdp:2>zero2:1,fsdp:2>zero3:1"
    done = run_command([sys.executable, "-m", "dpcompare", "checkpoint", "--cells", cells, "--steps", "2",
                        "--model", f"hf:{tmp_path / 'tiny-llama'}", "--global-batch", "8", "--run-arg=--seq-len=16",
                        "--out", str(out)], cwd=tmp_path, env=child_env(tmp_path), timeout_s=2400)
    assert done.returncode == 0, done.output[-4000:]
    ran = json.loads(next(out.glob("*/checkpoint.json")).read_text())["cells"]
    assert [c["cell"] for c in ran] == cells.split(",")
    for cell in ran:
        load = cell["load_run"]
        assert cell["status"] == "ran" and cell["tool"] == "dpcompare convert", cell
        assert cell["save_run"]["verdict"] == load["verdict"] == "equivalent", cell
        parts = load["checkpoint"]["loaded"]["parts"]
        assert parts["parameters"] == "bitwise equal (21)" and parts["optimizer"] == "bitwise equal (21 parameters)"
        assert load["steps"] == [2, 3]


@pytest.mark.slow
def test_a_users_own_zero3_script_with_two_groups_moves_to_dcp_and_into_a_fresh_zero2_engine(tmp_path):
    """Not dpcompare's run: a script of DeepSpeed's own API (tests/deepspeed_script.py: torch's AdamW with weight decay
    on the weights alone, `engine.save_checkpoint(folder)` with DeepSpeed's tag). Its ZeRO-3 checkpoint into DCP, read
    back; from DCP into a universal checkpoint that a fresh ZeRO-2 engine loads. Each parameter's fp32 weight and
    moments, as DeepSpeed's own safe_get_* read them, bitwise through both; each group's hyper-parameters kept; and
    into ZeRO-3 the two groups are refused (its universal loader gives every group the first group's)."""
    script = Path(__file__).with_name("deepspeed_script.py")
    env = child_env(tmp_path)

    def ds(*args: str) -> None:
        done = run_command([sys.executable, str(script), *args], cwd=tmp_path, env=env, timeout_s=300)
        assert done.returncode == 0, done.output[-3000:]

    ds("save", str(tmp_path / "ckpt"), "3", str(tmp_path / "saved.pt"))
    saved = torch.load(tmp_path / "saved.pt", weights_only=False)
    _, _, _, apart = convert(tmp_path / "ckpt", tmp_path / "dcp", "dcp", check=True)
    assert apart == []
    read = tf.read_dcp(tmp_path / "dcp")
    for name, s in saved["params"].items():
        assert torch.equal(read.weights[name], s["fp32"]) and read.weights[name].dtype == s["fp32"].dtype, name
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(read.optimizer[name][k], s[k]), (name, k)
    assert [(g["weight_decay"], g["params"]) for g in read.groups] == [
        (0.1, ["0.weight", "2.weight", "4.weight"]), (0.0, ["0.bias", "2.bias", "4.bias"])]
    with pytest.raises(Refused, match="ZeRO-3's universal loader gives every group the first group's"):
        convert(tmp_path / "dcp", tmp_path / "zero3", "deepspeed", zero_stage=3)
    assert not (tmp_path / "zero3").exists()
    convert(tmp_path / "dcp", tmp_path / "zero2", "deepspeed", zero_stage=2, tag="moved", check=True)
    env["MASTER_PORT"] = "29613"
    ds("load", str(tmp_path / "zero2"), "2", str(tmp_path / "loaded.pt"), "moved")
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=False)
    for name, s in saved["params"].items():
        for k, v in s.items():
            assert loaded["params"][name][k].dtype == v.dtype and torch.equal(loaded["params"][name][k], v), (name, k)
    assert loaded["groups"] == saved["groups"] and loaded["global_steps"] == saved["global_steps"] == 3
