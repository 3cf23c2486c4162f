"""Benchmarks for ds_ring: every configuration in fresh rank processes (:mod:`benchmarks.driver`).

Run one from the repository root, e.g. ``python -m benchmarks.dilated --quick``; ``python -m benchmarks``
runs the suite; ``benchmarks/README.md`` says what each measures and how to add one.
"""
