"""The optimizer step replayed apart from the backend.

Owns: optimizer_replay (the reference optimizer step, one optimizer per parameter group), replay_ranges (the replay
divided: each range's owner replays its own), optimizer_rebuild (the user's optimizer and schedule rebuilt over a
copy of the template), clipping_rule (--clip-grad-norm as the references apply it), divisor_power (the update check's
power against a wrong gradient divisor). May import oracle, ranks, randomness and judgement.
"""
