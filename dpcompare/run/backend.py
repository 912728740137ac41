"""Choosing the backend: the adapter class for `--backend`, refused where its launcher cannot run it, and
the `Settings` it is built with, checked against what it declares before anything starts.

Owns: every check of the run's backend-facing settings — the launcher, `--compression` against the
compressions it offers, `--dp-devices` against whether it replicates over devices, and each `--opt KEY=VALUE`
against its declared options. Errors are one line (ValueError) naming what is accepted.
"""

from __future__ import annotations

from dataclasses import fields

from dpcompare.contract import Adapter, Settings
from dpcompare.run import registry
from dpcompare.run.config import RunConfig, initial_loss_scale
from dpcompare.contract.launch_env import LaunchEnv


def load_adapter_class(cfg: RunConfig, env: LaunchEnv) -> type[Adapter]:
    cls = registry.load(cfg.backend, registry.BACKENDS, "backend")
    if not (isinstance(cls, type) and issubclass(cls, Adapter)):
        raise ValueError(f"backend {cfg.backend!r} is not a dpcompare.contract.Adapter subclass: derive your adapter from it")
    caps = cls.capabilities
    if env.world_size > 1 and not caps.multi_process:
        raise ValueError(
            f"--backend {cfg.backend} runs in one process, but {env.launcher} started {env.world_size}: "
            f"start it as: {caps.launch_hint}"
        )
    if env.world_size > 1 and env.launcher not in caps.launchers:
        raise ValueError(
            f"--backend {cfg.backend} cannot run under {env.launcher} (its ranks would not find each other): "
            f"start it as: {caps.launch_hint}"
        )
    return cls


def _flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def parse_options(cls: type[Adapter], cfg: RunConfig) -> dict[str, object]:
    """Every option `cls` declares, typed: the value given with --opt, else its default. A key that is a run
    setting (or the backend's own name for one) points at the run flag; any other unknown key is refused
    with the list of accepted keys."""
    declared = {o.name: o for o in cls.OPTIONS}
    run_fields = {f.name for f in fields(RunConfig)}
    values = {name: option.default for name, option in declared.items()}
    for key, raw in cfg.options.items():
        if key in declared:
            values[key] = declared[key].parse(raw)
            continue
        if key in run_fields:
            raise ValueError(f"--opt {key}={raw} is a run setting, not an option of --backend {cfg.backend}: "
                             f"use {_flag(key)} {raw} instead (checked for every backend)")
        if key in cls.NATIVE_NAMES:
            flag = _flag(cls.NATIVE_NAMES[key])
            raise ValueError(f"--opt {key}={raw} is {cfg.backend}'s own name for {flag}: use {flag} instead "
                             "(checked for every backend)")
        accepted = ("it accepts " + "; ".join(o.describe() for o in cls.OPTIONS)) if cls.OPTIONS \
            else "it takes no --opt options"
        raise ValueError(f"--opt {key}={raw} is not an option of --backend {cfg.backend}: {accepted}")
    return values


def settings_for(cls: type[Adapter], cfg: RunConfig) -> Settings:
    """The adapter's settings from the config, validated against its declared capabilities and options."""
    caps = cls.capabilities
    if cfg.compression not in caps.compressions:
        raise ValueError(f"--compression={cfg.compression} is not available for --backend {cfg.backend}: "
                         f"it supports {', '.join(sorted(caps.compressions))}")
    if cfg.dp_devices is not None and not caps.device_replicas:
        raise ValueError(f"--dp-devices={cfg.dp_devices} does not apply to --backend {cfg.backend}: it sizes backends "
                         "that replicate over devices in one process (dp); leave it out")
    if cfg.activation_checkpointing and not caps.activation_checkpointing:
        raise ValueError(f"--activation-checkpointing is not available for --backend {cfg.backend}: its adapter declares "
                         "that it cannot run blocks recomputed in backward; leave the flag out or choose another backend")
    if cfg.compile and not caps.compiles:
        raise ValueError(f"--compile is not available for --backend {cfg.backend}: its adapter declares no compiled path "
                         f"(Capabilities.compiles){': ' + caps.compile_refusal if caps.compile_refusal else ''}; leave "
                         "--compile out")
    # The fields declared settings=True, as the config holds them; the loss scale the run starts from and the
    # options typed as the adapter declares them.
    return Settings(**{**cfg.settings_values(), "loss_scale": initial_loss_scale(cfg),
                       "options": parse_options(cls, cfg)})


def variant_name(cls: type[Adapter], options: dict[str, object]) -> str:
    """The name of the variant the run's options make (`zero2` for deepspeed's zero_stage=2), or '' when they make
    none: the first declared variant whose values all hold and are not all the defaults."""
    defaults = {o.name: o.default for o in cls.OPTIONS}
    for name, values in cls.VARIANTS.items():
        if all(options.get(k) == v for k, v in values.items()) and any(defaults.get(k) != v for k, v in values.items()):
            return name
    return ""
