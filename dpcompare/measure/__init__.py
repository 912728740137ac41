"""What it costs: clocks, the memory window, the arithmetic of native communication counters, bandwidth
formulas, each concern's metrics written in its own module (step_time, ablation, comm, bandwidth, memory, volume,
trace, flops) and assembled in order into a run's metrics dict (run_metrics), and whether a result's figures hold
together (consistency); the model-state census and the ZeRO paper's formula (memory), the recorder of Python
collectives by kind (collectives) and the per-kind volume, predicted and measured (volume). Imports no adapter and no
command."""
