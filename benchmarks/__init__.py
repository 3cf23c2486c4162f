"""Benchmarks for ds_ring, each configuration in fresh rank processes (:mod:`benchmarks.driver`); run one from the
repository root, e.g. ``python -m benchmarks.dilated --quick`` (``python -m benchmarks``: the suite; see README.md)."""
