"""The state a run starts from, judged before its first step.

Owns: initial_state (what each rank built before the backend wraps it, and what the ranks hold before step 0),
loaded_state (the state a --load-checkpoint run loaded against what the saving run held). May import memory and
everything below it; not its siblings (diagnosis, trajectory, model_facts).
"""
