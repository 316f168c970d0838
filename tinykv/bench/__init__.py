"""Benchmarks: end to end (e2e.py), kernels (kernel.py), where a step goes (profile.py)."""
