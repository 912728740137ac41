"""The adapter contract: the only surface through which the trainer touches a backend.

Owns: the `Adapter` base class, composed of the contract's four parts, each in its own module, as a Lightning
Strategy is apart from its Precision plugin and its CheckpointIO:
  TrainingProtocol   (training_protocol) how the trainer drives the backend: the lifecycle and the step, what it
                     declares and refuses, autocast and the loss scaler, the control plane; the members a backend
                     must implement are named there
  CheckReads         (check_reads) where the backend keeps what the checks judge: full values, masters, optimizer
                     state, the wire and the facts the references reproduce
  MeasurementReads   (measurement_reads) the backend's facts measurement needs: messages, buffers, transport, counter
  CheckpointIO       (checkpoint_io) --save-checkpoint / --load-checkpoint by the backend's library
The last three have defaults that are right for a single-process backend (a module wrapped, gradients in `.grad`, a
plain torch optimizer), so a backend overrides only what differs. `ModelFacts` (what the trainer found out about the
model before wrapping) and `Wrapped` (what `wrap` returns) are training_protocol's; the data an adapter declares
(`Capabilities`, `Option`, `Settings`, `Note`) is dpcompare.contract.capabilities', its native communication counter
(`CommCounter` -> `CommCounts`) dpcompare.contract.comm_counter's; all are importable from here too. An adapter
translates; it holds no timers, no comparisons and no file I/O: measurement times what the counter points at.
Imports no adapter.
"""

from __future__ import annotations

from dpcompare.contract.capabilities import Capabilities, Note, Option, Settings
from dpcompare.contract.check_reads import CheckReads
from dpcompare.contract.checkpoint_io import CheckpointIO
from dpcompare.contract.comm_counter import CommCounter, CommCounts, CounterWindow
from dpcompare.contract.measurement_reads import MeasurementReads
from dpcompare.contract.training_protocol import ModelFacts, TrainingProtocol, Wrapped


class Adapter(TrainingProtocol, CheckReads, MeasurementReads, CheckpointIO):
    """Base class with the single-process behaviour; backends override what differs.

    The four parts in this order (a member is each part's alone, so the order decides nothing but reads as the
    contract does): the training protocol (`TrainingProtocol`: setup -> wrap -> per step [sync(enabled) around
    forward+backward, backward, reduce, step, zero_grad] -> teardown; after `reduce()` returns, every parameter's
    `.grad` on every rank holds the mean of the per-rank gradients, the gradient of the global-batch loss), what the
    checks read (`CheckReads`), what measurement reads (`MeasurementReads`) and the checkpoints (`CheckpointIO`).
    """


CONTRACT_MODULES = frozenset(cls.__module__ for cls in Adapter.__mro__ if cls is not object)
"""The modules of the base class and its parts: the contract's own code, never a backend's (dpcompare.run.raised)."""


__all__ = ["Adapter", "Capabilities", "CheckReads", "CheckpointIO", "CommCounter", "CommCounts", "CounterWindow",
           "MeasurementReads", "ModelFacts", "Note", "Option", "Settings", "TrainingProtocol", "Wrapped"]
