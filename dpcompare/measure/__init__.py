"""What it costs: clocks, the memory window, the arithmetic of native communication counters, bandwidth
formulas, the summary of a run's metrics and whether a result's figures hold together (consistency); the
model-state census and the ZeRO paper's formula (memory), the recorder of Python collectives by kind
(collectives) and the per-kind volume, predicted and measured (volume). Imports no adapter and no command."""
