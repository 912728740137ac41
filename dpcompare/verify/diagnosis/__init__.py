"""Why a failed check failed, found by testing what each known fault would have produced.

Owns: diagnose (the entry points), failure_evidence (what rank 0 knows at a failed check), explanation (the claim
rule), the gradient, wire and update hypotheses, state_comparison (optimizer states compared). May import memory and
everything below it; not its siblings (trajectory, model_facts, starting_state).
"""
