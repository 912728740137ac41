"""Is it the same computation: the float64 oracle, the gradient / update / trajectory checks and the
diagnosis of a failed check. Imports the contract and the results, nothing above them (docs/ARCHITECTURE.md#layers)."""
