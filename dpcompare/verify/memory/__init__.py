"""Fitting the oracle into memory across ranks.

Owns: divider (the oracle's arithmetic divided over the ranks: every rank runs its own forwards, each parameter's sum
held by its owner), streamed_distance (a float64 gradient compared as backward produces it, never held whole),
handed_gradients (a rank's divided gradient sent to its owners a parameter at a time as backward completes it),
oracle_coverage (--check-coverage: how much of the model the oracle checks within the memory free). May import replay,
oracle, ranks, randomness and judgement.
"""
