"""What measurement reads from a backend: the part of the adapter contract that translates the backend's own facts
(its messages, its buffers, its transport, its counter) for the measured window. Measurement times what the counter
points at: an adapter holds no timers.

Owns: `MeasurementReads`. One of the four parts `dpcompare.contract.adapter.Adapter` is composed of; it reads the
state the training protocol's `__init__` sets (`env`, `device`). Imports no adapter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # set by TrainingProtocol: the parts import nothing from one another at run time
    import torch

    from dpcompare.contract.comm_counter import CommCounter
    from dpcompare.contract.launch_env import LaunchEnv


class MeasurementReads:
    """The backend's facts measurement needs, with defaults that are right for a single-process backend (no gradient
    communication of its own), so a backend overrides only what it has:

      no_communication_reason   one process: no gradient communication (None at any larger world size)
      link_transport            the backend of torch.distributed's default process group, None with one process
      message_bytes             no bucketed message (None, and why)
      comm_buffer_bytes         no memory held for communication (0)
      ablation_bytes            nothing the ablation's unsynced arm holds apart (0)
      comm_counter              no counter of its own (None: the run says it has none)
    """

    env: LaunchEnv
    device: torch.device

    # -- what measurement needs to know (translations of the backend's own facts) -----------------
    def no_communication_reason(self) -> str | None:
        """Why this run has no gradient communication to measure, or None when it has some."""
        return "one process, no gradient communication" if self.env.world_size == 1 else None

    def link_transport(self) -> str | None:
        """The transport its gradients' collectives cross (metrics.link names its facts): nccl, gloo or mpi, None
        with one process. Default: the backend of torch.distributed's default process group."""
        import torch.distributed as dist

        if self.env.world_size < 2 or not dist.is_available() or not dist.is_initialized():
            return None
        name = str(dist.get_backend())
        if "nccl" in name and self.device.type == "cuda":
            return "nccl"
        return next((t for t in ("gloo", "mpi", "nccl") if t in name), name)

    def message_bytes(self, grad_bytes: int) -> tuple[int | None, str | None]:
        """Size of one all-reduce message (bucket / fusion buffer) for this model, or (None, reason)."""
        return None, "this backend does not bucket its gradients"

    def comm_buffer_bytes(self, grad_bytes: int) -> int | None:
        """Memory the backend holds for communication (buckets, fusion buffer, flat buffers)."""
        return 0

    def ablation_bytes(self) -> int:
        """Device memory that the ablation's unsynced arm holds for the whole measured window and a training step
        would not (a second wrapper's buckets, say): left out of peak_mem_mib. Asked after comm_off() was
        entered once, empty, before the warm-up. Default 0."""
        return 0

    def comm_counter(self) -> CommCounter | None:
        """The backend's own communication counter for a measured window, or None when it has none. Only
        asked for when instrumentation is on."""
        return None
