"""What every check of a step is handed, built once a run and once a step.

Owns: check_context (the run's frozen CheckContext and CheckSettings, a check's Finding and its Point of the step),
run_instruments (the Bench: the oracle, the references and the forwards the checks share), step_evidence (what every
rank sent at a point of a step, and the oracle's side of it, computed once), backend_reads (what the ranks read from
the backend at a checked step), run_reference (the run-precision reference and its floor). May import diagnosis,
trajectory, model_facts, starting_state and everything below them; not checks or phase.
"""
