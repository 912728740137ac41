"""What it costs: clocks, the memory window, the arithmetic of native communication counters, bandwidth
formulas and the summary of a run's metrics. Imports no adapter and no command."""
