"""Is it the same computation: the float64 oracle, the gradient / update / trajectory checks and the
diagnosis of a failed check. Imports no adapter, no command and nothing from the run layer but its types."""
