"""What it costs: clocks, the memory window, the arithmetic of native communication counters, bandwidth
formulas and the summary of a run's metrics; the model-state census and the ZeRO paper's formula (memory), the
recorder of Python collectives by kind (collectives) and the per-kind volume, predicted and measured (volume).
Imports no adapter and no command."""
