"""What a rank executes: configuration, the launchers, the built-in workloads, the trainer and its watchdog.

Imports the verify and measure layers and the results module; never a command (dpcompare.commands).
"""
