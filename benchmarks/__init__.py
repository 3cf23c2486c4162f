"""ds_ring's benchmarks, each configuration in fresh rank processes: ``python -m benchmarks.<name>`` (README.md)."""
