"""Is it the same computation: the float64 oracle, the checks of every step, and the diagnosis of a failed check.

Imports the contract and the results, nothing above them (docs/ARCHITECTURE.md#layers). Inside, one subpackage a
concern, each importing only those below it (the "verify" contract of pyproject.toml's import-linter), top to bottom:

    phase           the verification phase on rank 0: the verdict's opening, then every step's checks in order
    checks          one module a check, and the list they run in
    instruments     what every check of a step is handed: the run's context, the shared instruments, the step's
                    evidence, the backend's reads, the run-precision reference
    diagnosis       why a failed check failed: the known faults, each tested
    trajectory      the reference trajectory: two single-process copies trained beside the run
    model_facts     facts about the model: its probe, its buffers' semantics, whether the ranks' split computes the
                    global batch's gradient, and why not
    starting_state  the state a run starts from: what each rank built, what a checkpoint's load restored
    memory          fitting the oracle into memory across ranks: its arithmetic divided, gradients compared as
                    backward makes them, the part of the model the memory free allows
    replay          the optimizer step replayed apart from the backend: its optimizer rebuilt, its clipping rule
    oracle          the float64 copies of the model and the gradients they compute
    ranks           the verifier's own process group and the parameters' ranges cut over it
    randomness      the random numbers a forward draws: found, recorded, shipped, replayed
    judgement       what a verdict is made of: the tolerance and power, the records, the precision recipe
"""
