"""Deliberately broken HSDP (`--backend fsdp --opt replicas=R`), for tests/test_hsdp.py.

The fault plants itself behind the unchanged adapter contract: the replica groups are made as HSDP makes them, but
`fully_shard` is handed the rank's own row of the (replicate, shard) mesh, a 1-D shard sub-mesh, instead of the whole
2-D mesh. Each group then shards and reduce-scatters within itself and never all-reduces with the other groups: it
trains as if it were the only one (pytorch/pytorch#140183, HYBRID_SHARD training as if on one node). Loaded the way
a user's adapter is: `--backend tests.faulty_hsdp:ReplicaGroupOnlyHSDP --opt replicas=2`.

Not a test module (no `test_` prefix): pytest does not collect it.
"""

from __future__ import annotations

from dpcompare.adapters.fsdp import FSDPAdapter


class ReplicaGroupOnlyHSDP(FSDPAdapter):
    """HSDP whose replicate dimension is dropped: every `fully_shard` call gets the mesh's "shard" dimension alone,
    so a rank's gradient is the mean over its own replica group's ranks, and the full values it reads
    (`DTensor.full_tensor()`) are its group's."""

    name = "replica-group-only-hsdp"

    def setup(self, timeout_s: float) -> None:
        super().setup(timeout_s)
        if self.replicas > 1:
            self.mesh = self.mesh["shard"]
