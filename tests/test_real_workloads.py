"""Real workloads: ResNet-18/50 and GPT-2-style LMs as one flag, and the process-group backend option.

The networks must be the published ones: ResNet-18 and ResNet-50 have torchvision's parameter counts
(11,689,512 and 25,557,032 with 1000 classes; where torchvision imports, the very same state_dict layout)
and gpt2-small is GPT-2's 124M configuration (124,439,808 parameters with the tied head). Their data is
deterministic per (seed, step) and shaped as named. Multi-process: a dropout GPT is `equivalent` under every
backend at world size 2 because the oracle applies the masks each rank drew, and its negative twin, an
adapter that gives every rank the same dropout seed, is caught (test_negative.py); ResNet with BatchNorm is
`equivalent` with --sync-bn (the global batch) and without it (per replica, its distance stated; the negative
twins of that judgement are in test_semantics.py). `--opt dist_backend=nccl` on CPU is refused in one
line, and NCCL on ranks that share one GPU is refused before it can fail obscurely.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from dpcompare.run import real_models, registry
from dpcompare.contract.process_group import ProcessGroupMixin


def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize(("arch", "published"), [("resnet18", 11_689_512), ("resnet50", 25_557_032)])
def test_resnet_is_torchvisions_network(arch: str, published: int) -> None:
    ours = real_models.build_resnet(arch, 1000, prefer_torchvision=False)[0]
    assert _params(ours) == published
    if real_models.torchvision_problem() is None:
        import torchvision

        theirs = getattr(torchvision.models, arch)(weights=None, num_classes=1000)
        assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}
        theirs.load_state_dict(ours.state_dict())  # the layouts are interchangeable


def test_a_missing_torchvision_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def no_torchvision(name: str, *args):
        if name.startswith("torchvision"):
            raise RuntimeError("operator torchvision::nms does not exist")
        return real(name, *args)

    monkeypatch.setattr(real_models.importlib, "import_module", no_torchvision)
    problem = real_models.torchvision_problem()
    assert problem is not None and "torchvision::nms" in problem and "pip install torchvision" in problem
    assert "download.pytorch.org/whl/" in problem
    assert real_models.build_resnet("resnet18", 10)[1].startswith("dpcompare")


def test_gpt2_small_is_the_124m_configuration() -> None:
    c = real_models.GPT_SIZES["gpt2-small"]
    assert (c.vocab, c.context, c.layers, c.heads, c.dim, c.dropout) == (50257, 1024, 12, 12, 768, 0.1)
    assert _params(real_models.GPT(c)) == 124_439_808


@pytest.mark.parametrize(("name", "x_shape", "classes"), [
    ("resnet18-cifar", (4, 3, 32, 32), 10), ("gpt-tiny", (4, 64), 256)])
def test_real_workloads_build_from_the_registry(name: str, x_shape: tuple, classes: int) -> None:
    factory = registry.load(name, registry.MODELS, "model")
    a, b = factory(7), factory(7)
    x, y = a.make_batch(3, 4)
    assert tuple(x.shape) == x_shape
    assert torch.equal(x, b.make_batch(3, 4)[0]) and not torch.equal(x, a.make_batch(4, 4)[0])
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)  # every rank builds the same weights from the seed
    logits = a.model.eval()(x)
    assert logits.shape[-1] == classes and torch.isfinite(a.loss_fn(logits, y))
    assert a.name == name and a.source


def test_the_gpt_draws_dropout_in_modules_the_verifier_finds() -> None:
    from dpcompare.verify.randomness import random_modules

    model = real_models.gpt_tiny(0).model
    found = random_modules.random_modules(model)
    assert "drop" in found and "h.0.attn.attn_dropout" in found and len(found) == 1 + 3 * 2


def _drawn_masks(workload, seed: int):
    """The masks a float32 forward of the workload's model draws from `seed` (captured, as on a rank)."""
    from dpcompare.verify.randomness import draw_recording as mk

    x, _ = workload.make_batch(0, 2)
    recorder = mk.MaskRecorder(workload.model)
    torch.manual_seed(seed)
    with recorder.recording():
        workload.model.train()(x)
    return recorder.take().calls()


def _oracle_gradient(model: torch.nn.Module, workload, masks) -> dict[str, torch.Tensor]:
    from dpcompare.verify.oracle import gradient_oracle as eq
    from dpcompare.verify.randomness import draw_recording as mk

    x, y = workload.make_batch(0, 2)
    return eq.accumulate_gradient(model, workload.loss_fn, eq.global_pieces((x, y), masks), torch.device("cpu"),
                                  mk.MaskReplayer(model))[0]


def test_the_verification_copy_recomputes_activations_without_changing_the_gradient() -> None:
    """The float64 copies the verifier checks against recompute the GPT's blocks in backward (a 124M model's
    float64 activations would not fit beside the run); the gradient, captured dropout masks applied in the
    forward and again in the recomputation, is bit for bit the one the plain copy computes. Negative: other
    masks give another gradient, so the equality is not that of a model without randomness."""
    import copy

    from dpcompare.verify.oracle import gradient_oracle as eq

    workload = real_models.gpt_tiny(0)
    lean = eq.verification_copy(workload.model, torch.device("cpu"), torch.float64)
    plain = copy.deepcopy(workload.model).double()
    assert lean.recompute_activations and not plain.recompute_activations and not workload.model.recompute_activations
    masks = _drawn_masks(workload, 7)
    assert masks and all(masks.values())
    want = _oracle_gradient(plain, workload, masks)
    got = _oracle_gradient(lean, workload, masks)
    assert all(torch.equal(got[n], want[n]) for n in want)
    other = _oracle_gradient(lean, workload, _drawn_masks(workload, 8))
    assert not all(torch.equal(other[n], want[n]) for n in want)


# -- --opt dist_backend ---------------------------------------------------------------------------------
def _group(choice: str, device: str, local_world_size: int = 1) -> ProcessGroupMixin:
    g = ProcessGroupMixin()
    g.device = torch.device(device)
    g.env = SimpleNamespace(local_world_size=local_world_size)
    g.settings = SimpleNamespace(options={"dist_backend": choice})
    return g


@pytest.mark.parametrize(("choice", "want"), [("auto", "gloo"), ("gloo", "gloo")])
def test_dist_backend_on_cpu(choice: str, want: str) -> None:
    assert _group(choice, "cpu").dist_backend() == want


def test_nccl_on_cpu_is_refused() -> None:
    with pytest.raises(ValueError, match="dist_backend=nccl needs CUDA tensors"):
        _group("nccl", "cpu").dist_backend()


def test_nccl_on_a_shared_gpu_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="NCCL refuses two ranks on one device: use --opt dist_backend=gloo"):
        _group("auto", "cuda:0", local_world_size=2).dist_backend()
    assert _group("gloo", "cuda:0", local_world_size=2).dist_backend() == "gloo"
    assert _group("auto", "cuda:0", local_world_size=1).dist_backend() == "nccl"


def test_fsdp_refuses_ranks_sharing_a_gpu_and_gloo_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP2 over gloo on CUDA tensors crashed every rank on an H200 (SIGSEGV, no line): refused before the start."""
    from dpcompare.adapters.fsdp import FSDPAdapter

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    def fsdp(choice: str, device: str, local_world_size: int):
        adapter = FSDPAdapter.__new__(FSDPAdapter)  # the process-group choice alone: no group is made
        adapter.device, adapter.env = torch.device(device), SimpleNamespace(local_world_size=local_world_size)
        adapter.settings = SimpleNamespace(options={"dist_backend": choice})
        return adapter

    for choice, local in (("auto", 2), ("gloo", 2), ("gloo", 1)):
        with pytest.raises(ValueError, match="FSDP cannot put two ranks on one GPU"):
            fsdp(choice, "cuda:0", local).dist_backend()
    assert fsdp("auto", "cuda:0", 1).dist_backend() == "nccl"
    assert fsdp("auto", "cpu", 2).dist_backend() == "gloo"


def test_horovod_with_nccl_refuses_ranks_sharing_a_gpu_before_init(monkeypatch: pytest.MonkeyPatch) -> None:
    """Horovod built with NCCL reduces CUDA tensors over NCCL: two ranks on one GPU failed in every rank at NCCL's
    init on an H200 (ncclCommInitRank: invalid usage). Refused before hvd.init; a Horovod without NCCL, a GPU each,
    or the CPU are left alone."""
    hvd = pytest.importorskip("horovod.torch")
    from dpcompare.adapters.horovod import HorovodAdapter

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    inits: list[int] = []

    class Reached(Exception):
        pass

    def init() -> None:
        inits.append(1)
        raise Reached

    monkeypatch.setattr(hvd, "init", init)

    def setup(device: str, local_world_size: int, nccl: int) -> None:
        monkeypatch.setattr(hvd, "nccl_built", lambda: nccl)
        adapter = HorovodAdapter.__new__(HorovodAdapter)  # the check before hvd.init alone
        adapter.device = torch.device(device)
        adapter.env = SimpleNamespace(local_world_size=local_world_size, world_size=local_world_size, rank=0,
                                      launcher="horovodrun")
        adapter.settings = SimpleNamespace(options={"timeline": "off"}, instrument=False, bucket_mb=None)
        adapter.setup(60)

    with pytest.raises(ValueError, match="Horovod cannot put two ranks on one GPU"):
        setup("cuda:0", 2, nccl=22809)
    assert not inits  # refused before Horovod started anything
    for allowed in (("cuda:0", 1, 22809), ("cuda:0", 2, 0), ("cpu", 2, 22809)):
        with pytest.raises(Reached):
            setup(*allowed)
    assert len(inits) == 3


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_dist_backend_nccl_on_cpu_is_one_line_under_torchrun(launch) -> None:
    proc, result = launch("ddp", 2, "mlp", ["--opt", "dist_backend=nccl", "--steps", "1", "--measure-steps", "0"])
    assert proc.returncode != 0 and result is None
    lines = [line for line in proc.stderr.splitlines() if line.startswith("dpcompare: error")]
    assert lines and "dist_backend=nccl needs CUDA tensors" in lines[0], proc.output[-3000:]


# -- multi-process: the real models are checkable ---------------------------------------------------------
@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(330)
@pytest.mark.parametrize("backend", ["ddp", "horovod", "deepspeed"], indirect=True)
def test_dropout_gpt_is_equivalent_under_every_backend(backend: str, launch) -> None:
    proc, result = launch(backend, 2, "gpt-tiny", ["--steps", "2", "--global-batch", "8", "--measure-steps", "0"])
    assert proc.returncode == 0, proc.output[-4000:]
    e = result["equivalence"]
    assert e["verdict"] == "equivalent", e["notes"]
    assert e["stochastic"]["stochastic"] is True and e["stochastic"]["captured"] is True
    assert e["stochastic"]["capture_bytes_per_step"] > 0
    assert result["model_info"]["parameters"] == _params(real_models.gpt_tiny(0).model)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(330)
@pytest.mark.parametrize("sync_bn", [True, False])
def test_resnet_batchnorm_is_checked_with_and_without_sync_bn(launch, sync_bn: bool) -> None:
    """With --sync-bn one computation with the global batch; without it each replica normalises its own shard, which
    the oracle computes too, and the distance from the global batch is stated."""
    args = ["--steps", "1", "--global-batch", "8", "--measure-steps", "0"] + (["--sync-bn"] if sync_bn else [])
    proc, result = launch("ddp", 2, "resnet18-cifar", args)
    assert proc.returncode == 0, proc.output[-4000:]
    e = result["equivalence"]
    assert e["verdict"] == "equivalent", e["notes"]
    per_replica = [n for n in e["notes"] if n["code"] == "per_replica_batchnorm"]
    assert bool(per_replica) is not sync_bn and (e["batchnorm"] is None) is sync_bn, e["notes"]
    if not sync_bn:
        assert e["batchnorm"]["local_batch"] == 4 and e["batchnorm"]["floors"] > 10, e["batchnorm"]
