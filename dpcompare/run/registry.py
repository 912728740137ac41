"""Backend and workload registries: names to import paths, imported only when chosen.

Listing backends never imports Horovod or DeepSpeed. `package.module:Name` loads a user's own class or
function through the same path.
"""

from __future__ import annotations

import importlib
from typing import Any

BACKENDS: dict[str, str] = {
    # The order is the order every table, plot and `compare` run uses.
    "reference": "dpcompare.adapters.reference:ReferenceAdapter",
    "dp": "dpcompare.adapters.dp:DataParallelAdapter",
    "ddp": "dpcompare.adapters.ddp:DDPAdapter",
    "horovod": "dpcompare.adapters.horovod:HorovodAdapter",
    "deepspeed": "dpcompare.adapters.deepspeed:DeepSpeedAdapter",
    "fsdp": "dpcompare.adapters.fsdp:FSDPAdapter",
}

# What each backend needs importable, and how to get it (for `compare` and for clear errors).
REQUIREMENTS: dict[str, tuple[str, str]] = {
    "horovod": ("horovod.torch", "bash scripts/setup.sh (builds Horovod 0.28.1 against your torch)"),
    "deepspeed": ("deepspeed", "pip install deepspeed==0.19.8  (or: bash scripts/setup.sh)"),
}

MODELS: dict[str, str] = {
    "mlp": "dpcompare.run.workloads:mlp",
    "mlp-wide": "dpcompare.run.workloads:mlp_wide",
    "mlp-dropout": "dpcompare.run.workloads:mlp_dropout",
    "mlp-unused": "dpcompare.run.workloads:mlp_unused",
    "cnn": "dpcompare.run.workloads:cnn",
    "lm": "dpcompare.run.workloads:lm",
    "resnet18": "dpcompare.run.real_models:resnet18",
    "resnet50": "dpcompare.run.real_models:resnet50",
    "resnet18-cifar": "dpcompare.run.real_models:resnet18_cifar",
    "resnet50-cifar": "dpcompare.run.real_models:resnet50_cifar",
    "gpt-tiny": "dpcompare.run.real_models:gpt_tiny",
    "gpt-mini": "dpcompare.run.real_models:gpt_mini",
    "gpt2-small": "dpcompare.run.real_models:gpt2_small",
    "gpt2-medium": "dpcompare.run.real_models:gpt2_medium",
}


class UserCodeError(ValueError):
    """The user's own code (a --model function, a --backend class, their module) raised: one line saying so,
    then the traceback of their code (the exception's __cause__), exit 2."""


def load(spec: str, table: dict[str, str], kind: str) -> Any:
    """Resolve a registered name or `package.module:Name`; errors list what is available."""
    path = table.get(spec, spec)
    named, _, variant = spec.partition(":")
    if kind == "backend" and named in table and variant:
        raise ValueError(_variant_refusal(spec, load(named, table, kind)))
    module_name, _, attr = path.partition(":")
    if ":" not in path:
        raise ValueError(
            f"unknown {kind} {spec!r}: choose one of {', '.join(sorted(table))} or give package.module:Name"
        )
    if not module_name.strip() or not attr.strip():
        raise ValueError(f"--{kind} {spec!r} is invalid: package.module:Name needs both parts, e.g. mypkg.models:build")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name != exc.name and not module_name.startswith(exc.name + "."):
            raise UserCodeError(f"--{kind} {spec!r}: importing your module {module_name!r} failed") from exc
        missing = exc.name or module_name
        for name, (requirement, install) in REQUIREMENTS.items():
            if spec == name or missing.split(".")[0] == requirement.split(".")[0]:
                raise ImportError(f"{kind} {spec!r} needs {requirement}, which is not installed: {install}") from exc
        raise ValueError(f"--{kind} {spec!r}: cannot import module {module_name!r} ({exc}); check the name and PYTHONPATH") from exc
    except Exception as exc:  # the user's module itself raised (a syntax error, an import inside it, ...)
        raise UserCodeError(f"--{kind} {spec!r}: importing your module {module_name!r} raised "
                            f"{type(exc).__name__}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"--{kind} {spec!r}: module {module_name!r} has no attribute {attr!r}") from None


def _variant_refusal(spec: str, adapter: Any) -> str:
    """The line for `--backend NAME:VARIANT` (compare's way to name a variant): the run's own way to ask for it."""
    name, _, variant = spec.partition(":")
    variants = getattr(adapter, "VARIANTS", {}) or {}
    if variant in variants:
        from dpcompare.result_view import knob_text

        opts = " ".join(f"--opt {k}={knob_text(v)}" for k, v in variants[variant].items())
        return (f"--backend {spec!r}: a named variant is how compare's --backends says it; for one run give "
                f"--backend {name} {opts}")
    known = ", ".join(sorted(variants)) or "none"
    return f"--backend {spec!r}: {name} has no variant {variant!r} (its variants: {known}); give --backend {name}"


def availability(backend: str) -> tuple[bool, str]:
    """(available, reason) without importing the backend's runtime into this process."""
    import importlib.util

    if backend not in REQUIREMENTS:
        return True, ""
    requirement, install = REQUIREMENTS[backend]
    top = requirement.split(".")[0]
    if importlib.util.find_spec(top) is None:
        return False, f"{top} is not installed: {install}"
    return True, ""

