"""The verifier's own process group, and the trainable parameters cut into ranges over it.

Owns: verifier_group (Peers: the gloo group of the checks, the ranges' owners, sums sent to them), range_plan (which
rank holds which elements), range_cuts (a cut parameter's pieces sent and put back together), oracle_messages (what
rank 0 asks every rank, and the state it sends with it). May import randomness and judgement; not oracle.
"""
