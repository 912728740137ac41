"""The random numbers a forward draws: found, recorded at the dispatcher, shipped packed, replayed in other copies.

Owns: random_ops (the rule for each random aten op), draw_recording (MaskRecorder and the replay), packed_draws (a
draw in transit, one bit an element where it is a mask), random_modules (the modules that draw, --no-dropout, each
rank's own stream). May import judgement.
"""
