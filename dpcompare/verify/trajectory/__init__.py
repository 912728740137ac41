"""The reference trajectory: a float64 and a run-precision single-process copy trained beside the run.

Owns: reference_trajectory (the copies and their step), trajectory_offsets (the float64 copy held as offsets from the
run-precision one), trajectory_ranges (the copies held and stepped in ranges over the ranks). May import memory and
everything below it; not its siblings (diagnosis, model_facts, starting_state).
"""
