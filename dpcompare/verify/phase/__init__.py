"""The verification phase on rank 0: what the verdict says before the first step, then the checks of every step run in
order, and the verdict they add up to.

Owns: verifier (the Verifier: the list of checks at the two points of a step), verdict_opening (the notes before
step 0). May import every other subpackage of verify.
"""
