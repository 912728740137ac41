"""The float64 oracle: the copies of the model the checks compute with, and the gradients they compute.

Owns: gradient_oracle (the float64 oracle, the run-precision copies, the forwards a step's gradient is recomputed
from), float64_paths (how a float64 copy computes where a kernel has no float64 implementation), module_boundaries
(a backend's module boundaries drawn in a copy's graph: ZeRO-3), model_dtypes (a model's dtypes as the copies keep
them), weights_on_use (a copy's parameters made from the state it loads as its ops use them, never whole). May import
randomness and judgement; not ranks.
"""
