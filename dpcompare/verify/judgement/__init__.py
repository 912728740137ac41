"""What a verdict is made of.

Owns: tolerance (the tolerance policy and the power of a check: the only place either is written), verdict (the
per-step check records and the verdict they add up to), precision_recipe (the run's precision recipe as the checks
recompute it, the loss scaler's evidence), held_values (checking state held in the dtype it was computed in, read in
float64). Imports nothing of verify.
"""
