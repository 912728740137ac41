"""The message-size sweep of bench-collectives and its exact correctness check.

Owns: which sizes are measured (nccl-tests' -b/-e/-f), how many warm-up and timed iterations each size
gets, the rank-dependent fill pattern whose sum is exact in float32, checking a reduced buffer against
it, and reading and printing byte counts. Imports numpy only.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

import numpy as np

PATTERN_PERIOD = 251
"""Prime period of the fill pattern, so a chunk reduced at the wrong offset shows up as wrong values."""

BYTES_PER_ELEMENT = 4  # float32
MIN_TIMED_ITERS = 3


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_bytes(text: str) -> int:
    """'1024', '1K', '1KiB', '256MiB', '1G' -> bytes (binary multiples, like nccl-tests' -b/-e). 'KB' and 'MB'
    are refused: they mean 1000 to some readers and 1024 to others."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:([kKmMgG])(?:i[bB])?|[bB])?\s*", str(text))
    if not match:
        raise ValueError(f"size {text!r} is not understood: give bytes as a whole number with an optional "
                         "binary suffix, e.g. 4096, 4K, 4KiB, 256MiB, 1G")
    return int(match.group(1)) * _UNITS[(match.group(2) or "").lower()]


def human_bytes(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


@dataclass(frozen=True, slots=True, kw_only=True)
class Sweep:
    min_bytes: int = 1 << 10
    """Smallest message, bytes (a multiple of 4: float32 elements)."""
    max_bytes: int = 256 << 20
    """Largest message, bytes; sizes are min_bytes * factor**k up to this."""
    factor: int = 4
    """Ratio between consecutive sizes."""
    iters: int = 50
    """Timed iterations per size at most (small sizes); large sizes run fewer, at least 3."""
    warmup: int = 5
    """Untimed iterations per size at most; large sizes run 2 (1 when --warmup 1)."""
    target_s: float = 0.2
    """About this much timed all-reduce work per size decides how many iterations large sizes get."""

    def __post_init__(self) -> None:
        if self.min_bytes < BYTES_PER_ELEMENT or self.min_bytes % BYTES_PER_ELEMENT:
            raise ValueError(f"--min-bytes={self.min_bytes} is invalid: use a positive multiple of "
                             f"{BYTES_PER_ELEMENT} (float32 elements), e.g. 1KiB")
        if self.max_bytes < self.min_bytes:
            raise ValueError(f"--max-bytes={self.max_bytes} is smaller than --min-bytes={self.min_bytes}: "
                             "raise --max-bytes or lower --min-bytes")
        if self.factor < 2 and self.max_bytes != self.min_bytes:
            raise ValueError(f"--factor={self.factor} is invalid: use a whole number of at least 2, e.g. 4")
        if self.iters < 1:
            raise ValueError(f"--iters={self.iters} is invalid: use at least 1 (3 or more for a median)")
        if self.warmup < 1:
            raise ValueError(f"--warmup={self.warmup} is invalid: use at least 1 (the first iteration sizes "
                             "the run and is never timed)")
        if not self.target_s > 0:
            raise ValueError(f"--target-s={self.target_s} is invalid: use a positive number of seconds, e.g. 0.2")

    def sizes(self) -> list[int]:
        out, size = [], self.min_bytes
        while size <= self.max_bytes:
            out.append(size)
            if self.factor < 2:
                break
            size *= self.factor
        return out

    def plan(self, estimate_s: float, phase: Literal["warmup", "timed"]) -> int:
        """Iterations for one phase of a size whose all-reduce takes about `estimate_s` (the slowest rank's).
        Small sizes get --warmup / --iters; large ones enough for ~target_s (a quarter of it for warm-up)."""
        if phase == "warmup":
            wanted = math.ceil(0.25 * self.target_s / max(estimate_s, 1e-9))
            return min(self.warmup, max(2, wanted))
        wanted = math.ceil(self.target_s / max(estimate_s, 1e-9))
        return min(self.iters, max(MIN_TIMED_ITERS, wanted))


def pattern(count: int, scale: int = 1) -> np.ndarray:
    """scale * ((i mod 251) + 1) as float32: rank r sends pattern(count, r+1), and the sum over n ranks is
    pattern(count, n(n+1)/2), exact. Built by repeating one period: no int64 index array of the full size."""
    return np.resize(np.arange(1, PATTERN_PERIOD + 1, dtype=np.float32) * np.float32(scale), count)


def check_sum(reduced: np.ndarray, world_size: int) -> bool:
    """True when `reduced` is exactly n(n+1)/2 * pattern, compared in chunks to bound the extra memory."""
    scale = world_size * (world_size + 1) // 2
    if PATTERN_PERIOD * scale >= 1 << 24:
        raise ValueError(f"world size {world_size} is too large for an exact float32 check: the sum would "
                         "exceed 2**24; use at most 350 ranks")
    chunk = PATTERN_PERIOD * 4096  # a multiple of the period, so every chunk starts at pattern value 1
    expected = pattern(chunk, scale)
    for start in range(0, reduced.size, chunk):
        part = reduced[start:start + chunk]
        if not np.array_equal(part, expected[:part.size]):
            return False
    return True
