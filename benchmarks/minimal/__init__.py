"""Minimal training loops, one per backend, written the way each backend's own documentation shows them: the
baselines of benchmarks/test_backend_overhead.py. Not collected by pytest (no test_ files)."""
