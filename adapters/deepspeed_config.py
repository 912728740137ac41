"""The DeepSpeed engine's configuration as the run's settings make it, and the notes that state it.

Owns: the config dict `deepspeed.initialize` is handed (batch sizes, gradient clipping, the ZeRO section, the
precision section: `torch_autocast` or the engine's own `bf16`/`fp16`), the refusals of a recipe DeepSpeed cannot run
here, and the verdict's notes on what the engine does differently from DDP (its clipping default, what a ZeRO stage
shards, its precision recipe). The adapter that builds the engine is adapters/deepspeed.py. Imports nothing of
dpcompare but its public API.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Mapping

import torch
from torch import nn

from dpcompare import AMP_NAMES, Note, Settings

from .deepspeed_autocast import gathered_note

WIRE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def check_precision(settings: Settings) -> None:
    """Refuse, before any work, a recipe DeepSpeed cannot run here (one line, exit 2)."""
    if settings.options["amp_recipe"] == "engine" and settings.amp == "none":
        raise ValueError("--opt amp_recipe=engine selects DeepSpeed's bf16/fp16 engine: add --amp bf16 or --amp fp16")
    refusal = precision_refusal(settings.amp, settings.options)
    if refusal is not None:
        raise ValueError(f"--amp fp16 --opt amp_recipe=engine: {refusal}; use --amp bf16, or the autocast recipe "
                         "(--opt amp_recipe=autocast), or a CUDA device")


def precision_refusal(amp: str, options: Mapping[str, Any]) -> str | None:
    """Why DeepSpeed cannot run `--amp amp` with these options here: its fp16 engine where its accelerator (the one
    the run would use) holds no fp16 weights; None: it can."""
    if options.get("amp_recipe") != "engine" or amp != "fp16":
        return None
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.is_fp16_supported():
        return None
    return (f"DeepSpeed's {accelerator.device_name()} accelerator does not support fp16 weights here "
            "(is_fp16_supported() is False)")


def optimizer_refusal(settings: Settings, optimizer: Any, scheduled: bool) -> str | None:
    """Why this DeepSpeed configuration cannot take the run's optimizer or a scheduler (None: it can): ZeRO-1/2 type
    their flat buffers by the first parameter of the first group (stage_1_and_2.py: `self.dtype =
    optimizer.param_groups[0]['params'][0].dtype`), so a non-float one there makes them integer; and where the engine's
    optimizer keeps an overflow flag (ZeRO 1-3, the fp16 engine), engine.step() leaves the scheduler unstepped on a step
    the loss scaler skips (DeepSpeedEngine._take_model_step), where a training loop steps it every step."""
    stage = int(settings.options.get("zero_stage", 0))
    groups = [g["params"] for g in optimizer.param_groups if g["params"]]
    first = groups[0][0] if groups else None
    if stage in (1, 2) and first is not None and not first.is_floating_point():
        return (f"ZeRO-{stage} types its flat buffers by the first parameter of the first group, here a {first.dtype} "
                "one: leave the non-float parameters out of the optimizer (no step moves them), or use --opt "
                "zero_stage=0 or 3")
    if scheduled and settings.amp == "fp16" and (stage or settings.options.get("amp_recipe") == "engine"):
        return ("under --amp fp16 its engine leaves the scheduler unstepped on a step its loss scaler skips "
                "(DeepSpeedEngine._take_model_step), where a training loop steps it every step, so its schedule would "
                "fall behind: use --amp bf16, or --opt zero_stage=0 with the autocast recipe, or no scheduler")
    return None


def sparse_gradient_refusal(settings: Settings) -> str | None:
    """Why this DeepSpeed configuration cannot take a sparse gradient (nn.Embedding(sparse=True)); None: it can. Stage 0
    all-gathers one's rows and values (DeepSpeedEngine.sparse_allreduce; 0.19.8, found running it)."""
    stage = int(settings.options.get("zero_stage", 0))
    if stage in (1, 2):
        return (f"ZeRO-{stage} (--opt zero_stage={stage}) views every gradient into its flat dense buckets "
                "(stage_1_and_2.py, reduce_independent_p_g_buckets_and_remove_grads: no sparse view; stage 0 "
                "all-gathers a sparse one: --opt zero_stage=0)")
    if stage == 3:
        return ("ZeRO-3 (--opt zero_stage=3) copies every gradient into its flat dense bucket (stage3.py, "
                "__add_grad_to_ipg_bucket: no copy_ from a sparse tensor; stage 0 all-gathers a sparse one: "
                "--opt zero_stage=0)")
    if settings.amp != "none" and settings.options.get("amp_recipe") == "engine":
        return (f"its engine recipe (--opt amp_recipe=engine) keeps the gradient in {settings.amp}, and a 16-bit sparse "
                "gradient rounds each repeated row apart and sums the rows when coalesced, unlike the dense reference "
                "the checks hold it against (the autocast recipe keeps float32 gradients)")
    if settings.clip_grad_norm is not None or float(settings.options.get("gradient_clipping", 0.0)):
        return ("its gradient clipping at stage 0 (runtime/utils.py clip_grad_norm_, for --clip-grad-norm or --opt "
                "gradient_clipping) scales `p.grad.data`, which leaves a sparse gradient unclipped while its norm "
                "counts it (drop the clipping)")
    return None


def check_scalar_parameters(module: nn.Module, stage: int) -> None:
    """Refuse, before DeepSpeed builds the engine, a model with a 0-dim parameter (CLIP's logit_scale) where this
    DeepSpeed broadcasts every parameter as bytes while it builds the engine (`p.data.view(torch.uint8)`, which torch
    refuses for a 0-dim tensor: "self.dim() cannot be 0 to view Float as Byte", raised inside DeepSpeed at any world
    size): DeepSpeedEngine._broadcast_model at every stage, zero.Init's _zero_init_param at stage 3 (0.19.8 does both).
    One line, exit 2, naming the parameters and what to do."""
    scalars = [n for n, p in module.named_parameters() if p.dim() == 0]
    sites = byte_broadcasts(stage) if scalars else []
    if not sites:
        return
    import deepspeed

    shown = ", ".join(scalars[:3]) + (f" and {len(scalars) - 3} more" if len(scalars) > 3 else "")
    raise ValueError(f"--backend deepspeed --opt zero_stage={stage} cannot run this model: {shown} "
                     f"{'is a 0-dim parameter' if len(scalars) == 1 else 'are 0-dim parameters'} (shape []), and "
                     f"DeepSpeed {deepspeed.__version__} broadcasts every parameter as bytes when it builds the engine "
                     f"(p.data.view(torch.uint8) in {' and '.join(sites)}), which torch refuses for a 0-dim tensor: "
                     "hold it as a 1-element tensor (torch.ones(1), not torch.ones([])), or use --backend ddp or "
                     "horovod")


def byte_broadcasts(stage: int) -> list[str]:
    """The places this DeepSpeed broadcasts each parameter viewed as bytes while it builds the engine at ZeRO `stage`
    (a 0-dim parameter cannot be so viewed), read from its source; none where the source cannot be read."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    methods = {"DeepSpeedEngine._broadcast_model": DeepSpeedEngine._broadcast_model}
    if stage == 3:
        from deepspeed.runtime.zero.partition_parameters import Init

        methods["zero.Init._zero_init_param"] = Init._zero_init_param
    found = []
    for name, method in methods.items():
        try:
            source = inspect.getsource(inspect.unwrap(method))
        except (OSError, TypeError):
            continue
        if ".view(torch.uint8)" in source:
            found.append(name)
    return found


def engine_config(settings: Settings, stage: int, clip: float, module: nn.Module, local_batch: int,
                  global_batch: int) -> dict:
    """What `deepspeed.initialize` is handed for this run."""
    config = {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": local_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": clip,
        "zero_optimization": _zero_config(settings, stage),
        "steps_per_print": 1 << 30,
        # Its timers are the native communication counter ('bwd_allreduce'); on CUDA they synchronise,
        # so they run only when the run is instrumented.
        "wall_clock_breakdown": settings.instrument,
        **_precision_config(settings, module),
    }
    if settings.compression != "none":
        config["communication_data_type"] = settings.compression
    return config


def _precision_config(settings: Settings, module: nn.Module) -> dict:
    amp, recipe = settings.amp, settings.options["amp_recipe"]
    if amp == "none":
        return {}
    if recipe == "autocast":
        return {"torch_autocast": {"enabled": True, "dtype": AMP_NAMES[amp]}}
    cast_buffers = settings.options["buffer_dtype"] == "amp"
    batchnorms = [n for n, m in module.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if batchnorms and not cast_buffers:
        # DeepSpeed >= 0.19 casts the parameters only (buffers keep their dtype, for rotary inv_freq and the like),
        # and torch's batch_norm refuses 16-bit weights with float32 running statistics.
        raise ValueError(f"--opt amp_recipe=engine with BatchNorm ({', '.join(batchnorms[:3])}"
                         f"{' ...' if len(batchnorms) > 3 else ''}): DeepSpeed casts the weights to {AMP_NAMES[amp]} "
                         "and keeps the buffers in float32, which BatchNorm cannot mix; add --opt buffer_dtype=amp "
                         "(its data_types.buffer_dtype) or use the autocast recipe")
    types = {"data_types": {"buffer_dtype": amp}} if cast_buffers else {}
    if amp == "bf16":
        return {"bf16": {"enabled": True}, **types}
    # loss_scale 0: dynamic; the initial scale is 2^initial_scale_power (a power of two, checked by the config)
    return {"fp16": {"enabled": True, "loss_scale": 0,
                     "initial_scale_power": int(math.log2(settings.loss_scale or 2.0**16))}, **types}


def _zero_config(settings: Settings, stage: int) -> dict:
    config: dict = {"stage": stage}
    if stage and settings.bucket_mb:
        elements = int(settings.bucket_mb * 2**20 / 4)  # DeepSpeed sizes its buckets in elements
        config.update(reduce_bucket_size=elements, allgather_bucket_size=elements)
    if stage == 3:
        config["stage3_param_persistence_threshold"] = settings.options["param_persistence_threshold"]
    return config


def clipping_note(settings: Settings, clip: float, stage: int, engine_recipe: bool) -> str:
    if settings.clip_grad_norm is not None:
        return (f"deepspeed: gradient_clipping={clip:g} (--clip-grad-norm): the engine clips inside its step; "
                "the norm it clipped by is engine.get_global_grad_norm()" +
                (" (at stage 0 with the client optimizer the engine drops the norm its clip_grad_norm_ returns: "
                 "the adapter keeps it)" if not stage and not engine_recipe else ""))
    if not clip:
        return ("deepspeed: gradient_clipping set to 0.0 (DeepSpeed >= 0.19.3 clips at 1.0 by default, which "
                "changes the update relative to DDP and Horovod)")
    return f"deepspeed: gradient_clipping={clip:g} (--opt): the update is clipped, unlike DDP's and Horovod's"


def stage_note(settings: Settings, stage: int, world_size: int) -> str:
    held = {1: "the optimizer state and the fp32 parameters", 2: "the optimizer state, the fp32 parameters and the "
            "reduced gradients", 3: "the optimizer state, the fp32 parameters, the reduced gradients and the "
            "parameters"}[stage]
    return (f"deepspeed: ZeRO stage {stage}: each of the {world_size} rank(s) holds a 1/{world_size} partition of "
            f"{held}; the checks assemble the full gradients, fp32 parameters and optimizer state with DeepSpeed's "
            "safe_get_full_* accessors"
            + (" and gather the parameters (zero.GatheredParameters)" if stage == 3 else "")
            + ("; stages 2 and 3 reduce every micro-batch (no communication-free step for the ablation)"
               if stage >= 2 else "")
            + ("; ZeRO-3 allocates its gradient bucket at its full reduce_bucket_size (DeepSpeed's default 5e8 "
               "elements, 1.9 GiB in float32) whatever the model's size: the census counts it as a comm buffer; "
               "--bucket-mb sizes it" if stage == 3 and not settings.bucket_mb else ""))


def setting_notes(settings: Settings, stage: int, clip: float, engine_recipe: bool, world_size: int,
                  optimizer_name: str | None) -> list[Note]:
    """What the engine's settings change, stated for the verdict; `optimizer_name`: the client optimizer's class
    when ZeRO runs it off its list of tested optimizers."""
    notes = [Note("deepspeed.gradient_clipping", clipping_note(settings, clip, stage, engine_recipe))]
    if stage:
        notes.append(Note("deepspeed.zero_stage", stage_note(settings, stage, world_size),
                          ("masters", "grads", "optimizer")))
    if stage and not engine_recipe and settings.amp == "fp16":
        notes.append(Note("deepspeed.zero_autocast_fp16",
                          f"deepspeed: ZeRO stage {stage} under the torch_autocast section (fp16) tests its "
                          "partitions for overflow itself and returns before its GradScaler's update(), so the "
                          "loss scale never comes down after an overflow and every later step is skipped (the "
                          "verdict says `different`, cause scale_never_lowered, when it happens); the engine "
                          "recipe (--opt amp_recipe=engine), bf16 or ZeRO stage 0 back off"
                          + ("; with gradient_clipping its norm is the scaled gradients' (its own loss scale is 1 "
                             "there, the GradScaler's is not divided out): it reports and clips by the loss scale "
                             "times the norm (cause grad_norm_scaled)" if clip else "")))
    if optimizer_name is not None:
        notes.append(Note("deepspeed.untested_optimizer",
                          f"deepspeed: {optimizer_name} is not on ZeRO's list of tested optimizers: "
                          "zero_allow_untested_optimizer is set, and the update check replays its step"))
    if settings.bucket_mb and not stage:
        notes.append(Note("knob_not_applicable",
                          "deepspeed: --bucket-mb does not apply to ZeRO stage 0 (allreduce_bucket_size is a stage "
                          "1-3 setting); all gradients go in one flattened all-reduce"))
    return notes


def precision_notes(settings: Settings, stage: int, engine_recipe: bool, engine, ds_optimizer,
                    narrow: list[str]) -> list[Note]:
    """The precision recipe that runs; `narrow`: the parameters ZeRO reduces in the autocast dtype."""
    amp = settings.amp
    if amp == "none":
        return []
    if not engine_recipe:
        scaled = " with the engine's own GradScaler (dynamic loss scale)" if amp == "fp16" else ""
        wire = (f"; ZeRO stage {stage} reduces the gradients of its lower_precision_safe_modules' parameters "
                f"(Linear, Conv: {len(narrow)} of {sum(1 for _ in engine.module.parameters())}) in "
                f"{AMP_NAMES[amp]}, judged with that wire's tolerance" if narrow else "")
        if narrow and stage == 3:
            wire += gathered_note(engine.module, set(narrow), AMP_NAMES[amp])
        return [Note("deepspeed.amp_recipe", f"deepspeed: autocast recipe (torch_autocast section, {AMP_NAMES[amp]}): "
                                             f"float32 weights, the engine's forward under torch.autocast{scaled}"
                                             f"{wire}", ("forward", "wire"))]
    wire = WIRE_NAMES.get(engine.communication_data_type, "float32")
    known = []
    if amp == "fp16" and not stage and stage0_fp16_loss_unscaled(type(engine)):
        known.append(Note("deepspeed.fp16_stage0_loss_unscaled",
                          "deepspeed: this DeepSpeed's engine.backward() scales the loss only for a ZeRO optimizer, "
                          f"while {type(ds_optimizer).__name__}.step() divides the gradients by the loss scale "
                          "(deepspeedai/DeepSpeed#8393): at ZeRO stage 0 every update is the loss scale times too "
                          "small and no overflow is ever seen; the verdict shows what that does to this run"))
    return known + [Note("deepspeed.amp_recipe",
                 f"deepspeed: engine recipe ({amp} section): {AMP_NAMES[amp]} weights and gradients, all-reduced in "
                 f"{wire}; fp32 master weights stepped by the client optimizer inside {type(ds_optimizer).__name__}"
                 + (", which takes one optimizer step on zero gradients when it is built "
                    "(initialize_optimizer_states)" if not stage else
                    f", partitioned across the ranks (ZeRO stage {stage})")
                 + ("; dynamic loss scale" if amp == "fp16" else ""), ("forward", "masters", "grads", "wire", "loss_scale"))]


def stage0_fp16_loss_unscaled(engine_class: type) -> bool:
    """Does this DeepSpeed's engine.backward() leave the loss unscaled for the fp16 optimizers of ZeRO stage 0? True
    where its source scales only for a ZeRO optimizer (or torch autocast's GradScaler) and has no fp16 branch, as
    0.19.8 does (deepspeedai/DeepSpeed#8393 adds the branch); False where the source cannot be read."""
    method = inspect.unwrap(getattr(engine_class, "backward", None))
    try:  # DeepSpeed's instrument_w_nvtx wraps it without functools.wraps: the method is its closure's `func`
        method = inspect.getclosurevars(method).nonlocals.get("func", method)
        source = inspect.getsource(method)
    except (OSError, TypeError, AttributeError):
        return False
    return "scale_if_loss" in source and "fp16_enabled" not in source
