"""Real workloads: ResNet-18/50 (the standard data-parallel benchmark) and GPT-2-style causal LMs.

Owns: `--model resnet18|resnet50` (ImageNet-shaped: 3x224x224, 1000 classes) and their `-cifar` twins
(3x32x32, 10 classes), and `--model gpt-tiny|gpt-mini|gpt2-small|gpt2-medium`, with deterministic synthetic
data built from the seed. Nothing is downloaded: weights are initialised from the seed, data is generated.

ResNet: torchvision's own `resnet18` / `resnet50` when torchvision imports (it is an optional extra: the
CPU build must match torch, see docs/workloads.md); otherwise this module's definition of the same network, with
torchvision's module names, shapes and initialisation (v1.5: the stride sits in the bottleneck's 3x3), so a
state_dict moves between the two. `Workload.source` records which one ran.

GPT: the GPT-2 architecture (learned positions, pre-LayerNorm blocks, tanh-GELU MLP, output head tied to
the token embedding, scaled init of the residual projections) with dropout 0.1 on embeddings, attention
probabilities and residuals, in nn.Dropout modules, as GPT-2 trains. dpcompare's verifier finds those
modules and applies the masks each rank drew in the float64 oracle, so a dropout GPT is checkable, not waved
through. `gpt2-small` is the real 124M configuration (vocab 50257, context 1024, 12 layers, 12 heads, 768).
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dpcompare.run.workloads import IGNORE_INDEX, Workload, _cross_entropy, _generator, token_batch


# -- ResNet ------------------------------------------------------------------------------------------------
def _conv(cin: int, cout: int, k: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv(cin, width, 3, stride), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = _conv(width, width, 3), nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv(cin, width, 1), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = _conv(width, width, 3, stride), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = _conv(width, width * 4, 1), nn.BatchNorm2d(width * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


class ResNet(nn.Module):
    """torchvision.models.ResNet's layout (module names and shapes), without its options."""

    def __init__(self, block: type[BasicBlock] | type[Bottleneck], layers: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.inplanes = 64
        self.conv1, self.bn1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._layer(block, 64, layers[0], 1)
        self.layer2 = self._layer(block, 128, layers[1], 2)
        self.layer3 = self._layer(block, 256, layers[2], 2)
        self.layer4 = self._layer(block, 512, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def _layer(self, block, width: int, blocks: int, stride: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != width * block.expansion:
            downsample = nn.Sequential(_conv(self.inplanes, width * block.expansion, 1, stride),
                                       nn.BatchNorm2d(width * block.expansion))
        layers = [block(self.inplanes, width, stride, downsample)]
        self.inplanes = width * block.expansion
        layers += [block(self.inplanes, width) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


_RESNETS = {"resnet18": (BasicBlock, (2, 2, 2, 2)), "resnet50": (Bottleneck, (3, 4, 6, 3))}


def torchvision_problem() -> str | None:
    """None when torchvision's models import; otherwise one line saying why and how to install it."""
    try:
        importlib.import_module("torchvision.models")
    except Exception as exc:  # a CUDA build of torchvision on a CPU torch raises RuntimeError, not ImportError
        return (f"torchvision does not import ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                f"install the build matching torch {torch.__version__}: pip install torchvision "
                f"--index-url https://download.pytorch.org/whl/{'cpu' if torch.version.cuda is None else 'cu' + torch.version.cuda.replace('.', '')}")
    return None


def build_resnet(arch: str, num_classes: int, prefer_torchvision: bool = True) -> tuple[nn.Module, str]:
    """(model, source): torchvision's network when it imports, else this module's identical layout."""
    if prefer_torchvision and torchvision_problem() is None:
        import torchvision

        return getattr(torchvision.models, arch)(weights=None, num_classes=num_classes), f"torchvision {torchvision.__version__}"
    block, layers = _RESNETS[arch]
    return ResNet(block, layers, num_classes), "dpcompare (torchvision's layout; torchvision not importable)"


def _resnet(arch: str, side: int, num_classes: int) -> Callable[[int], Workload]:
    def factory(seed: int) -> Workload:
        torch.manual_seed(seed)
        model, source = build_resnet(arch, num_classes)

        def make_batch(step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = _generator(seed, step)
            x = torch.randn(global_batch, 3, side, side, generator=g)
            return x, torch.randint(0, num_classes, (global_batch,), generator=g)

        suffix = "" if side == 224 else "-cifar"
        return Workload(f"{arch}{suffix}", model, make_batch, _cross_entropy, source=source)

    factory.__doc__ = f"{arch}: synthetic {side}x{side} RGB images, {num_classes} classes."
    return factory


resnet18 = _resnet("resnet18", 224, 1000)
resnet50 = _resnet("resnet50", 224, 1000)
resnet18_cifar = _resnet("resnet18", 32, 10)
resnet50_cifar = _resnet("resnet50", 32, 10)


# -- GPT ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPTConfig:
    vocab: int
    context: int
    layers: int
    heads: int
    dim: int
    dropout: float = 0.1


GPT_SIZES = {
    "gpt-tiny": GPTConfig(vocab=256, context=64, layers=2, heads=4, dim=64),
    "gpt-mini": GPTConfig(vocab=4096, context=256, layers=4, heads=4, dim=256),
    "gpt2-small": GPTConfig(vocab=50257, context=1024, layers=12, heads=12, dim=768),
    "gpt2-medium": GPTConfig(vocab=50257, context=1024, layers=24, heads=16, dim=1024),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.c_attn = nn.Linear(c.dim, 3 * c.dim)
        self.c_proj = nn.Linear(c.dim, c.dim)
        self.attn_dropout, self.resid_dropout = nn.Dropout(c.dropout), nn.Dropout(c.dropout)
        self.register_buffer("mask", torch.ones(c.context, c.context, dtype=torch.bool).tril(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.c_attn(x).split(d, dim=2))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = self.attn_dropout(att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.resid_dropout(self.c_proj(y))


class GPTBlock(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(c.dim), CausalSelfAttention(c), nn.LayerNorm(c.dim)
        self.mlp = nn.Sequential(nn.Linear(c.dim, 4 * c.dim), nn.GELU(approximate="tanh"), nn.Linear(4 * c.dim, c.dim),
                                 nn.Dropout(c.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2: token and learned position embeddings, pre-norm blocks, final LayerNorm, tied output head."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.config = c
        self.wte, self.wpe = nn.Embedding(c.vocab, c.dim), nn.Embedding(c.context, c.dim)
        self.drop = nn.Dropout(c.dropout)
        self.h = nn.ModuleList(GPTBlock(c) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.dim)
        self.recompute_activations = False
        """Recompute each block's activations in backward (dpcompare's float64 verification copies set it)."""
        for name, p in self.named_parameters():
            if p.dim() == 2:  # GPT-2's init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * layers)
                std = 0.02 / math.sqrt(2 * c.layers) if name.endswith(("c_proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.wte(tokens) + self.wpe(pos))
        for block in self.h:
            if self.recompute_activations and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False, preserve_rng_state=True)
            else:
                x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()


def _gpt(size: str) -> Callable[[int], Workload]:
    c = GPT_SIZES[size]

    def factory(seed: int, token_data: str = "padded") -> Workload:
        torch.manual_seed(seed)
        model = GPT(c)

        def make_batch(step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
            # A learnable stream: each token is the previous one plus a per-sequence stride, mod vocab; padded at
            # the end to lengths of its own unless packed.
            return token_batch(seed, step, global_batch, c.vocab, c.context, 8, token_data)

        return Workload(size, model, make_batch, _cross_entropy, tokens_per_sample=c.context, ignore_index=IGNORE_INDEX,
                        source=f"dpcompare GPT-2 architecture ({c.layers} layers, {c.heads} heads, {c.dim} wide, "
                               f"context {c.context}, vocab {c.vocab}, dropout {c.dropout:g})")

    factory.__doc__ = f"{size}: {GPT_SIZES[size]}"
    return factory


gpt_tiny = _gpt("gpt-tiny")
gpt_mini = _gpt("gpt-mini")
gpt2_small = _gpt("gpt2-small")
gpt2_medium = _gpt("gpt2-medium")
