"""The faults a run can be asked to plant (--inject-fault): a rank that crashes, is killed, stops or hangs at a step,
duplicated data, and a checkpoint's load gone wrong. What each does is the step runner's and the checkpoint's; this
module names them and reads their spelling. Imports no torch.
"""

from __future__ import annotations

from typing import Any

CHECKPOINT_FAULTS = ("ckpt-optimizer", "ckpt-step", "ckpt-shards", "ckpt-scale", "ckpt-data", "ckpt-rng")
"""Planted faults of a checkpoint's load (--load-checkpoint): the optimizer state dropped, its step counts reset, ranks
0 and 1's shards swapped, the loss scaler not restored, the data restarted at step 0, a rank's generator not
restored (ckpt-rng:RANK)."""


def fault_ok(text: str, _: Any) -> bool:
    parts = text.split(":")
    if parts[0] in CHECKPOINT_FAULTS:
        return len(parts) == 1 or (parts[0] == "ckpt-rng" and len(parts) == 2 and parts[1].isdigit())
    return parts == ["dupdata"] or (len(parts) == 3 and parts[0] in ("crash", "kill", "stop", "hang")
                                    and parts[1].isdigit() and parts[2].isdigit())
