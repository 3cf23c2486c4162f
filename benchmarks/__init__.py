"""Benchmarks for ds_ring: each configuration runs in a fresh subprocess (see ``harness``).

Run a benchmark as a module from the repository root, e.g. ``python -m benchmarks.dilated --quick``.
"""
