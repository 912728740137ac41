"""The contract: what a backend adapter and a workload are written against, and the vocabulary the library's
layers above share (docs/ARCHITECTURE.md).

  adapter        the `Adapter` base class, composed of the contract's four parts:
  training_protocol  `TrainingProtocol`: the lifecycle and the step, what the trainer tells it before wrapping
                 (ModelFacts) and what `wrap` returns (Wrapped), the members a backend must implement
  check_reads    `CheckReads`: where the backend keeps what the checks judge (single-process defaults)
  measurement_reads  `MeasurementReads`: the backend's facts measurement needs (single-process defaults)
  capabilities   what an adapter declares as data (Capabilities, Option, Note) and what reaches it (Settings)
  comm_counter   a backend's own communication counter (CommCounter, CounterWindow -> CommCounts)
  workload       `Workload`, `shard` (how a global batch splits across ranks) and `block_modules` (a model's blocks)
  activation_checkpointing  --activation-checkpointing: each block recomputes its forward in backward (nothing
                 to do with a saved checkpoint: that is checkpoint_io)
  checkpoint_io  saved checkpoints: their formats, a module's and optimizer's state saved and loaded, and
                 `CheckpointIO`, the contract's part that saves and loads a backend's (single-process defaults)
  launch_env     `LaunchEnv`: who started this process and which rank it is; the rendezvous for launchers that
                 set none
  process_group  `ProcessGroupMixin`: the process group, global BatchNorm and gathers a torch.distributed
                 backend mixes in
  syncbn         BatchNorm over the global batch through any all-reduce
  amp            the mixed-precision recipes (autocast, loss-scaler state)
  optim_state    reading a torch optimizer's state by parameter name
  sparse         sparse gradients (nn.Embedding(sparse=True)): found, read densified, refused where they cannot run

It imports nothing from the layers above it (run, verify, measure, commands): checked by import-linter
(pyproject.toml, tests/test_layers.py). The public API (`dpcompare.__all__`) re-exports from here.
"""

from dpcompare.contract.adapter import Adapter
from dpcompare.contract.training_protocol import ModelFacts, Wrapped
from dpcompare.contract.capabilities import Capabilities, Note, Option, Settings
from dpcompare.contract.comm_counter import CommCounter, CommCounts, CounterWindow

__all__ = ["Adapter", "Capabilities", "CommCounter", "CommCounts", "CounterWindow", "ModelFacts", "Note", "Option",
           "Settings", "Wrapped"]
