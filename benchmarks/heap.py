"""What ds_ring's CPU heap setting (``ds_ring/cpu_heap.py``) costs in time: ``benchmarks/SUITE.md``.

python -m benchmarks.heap --ranks 4 --strategies ulysses ring --tokens-per-rank 1024 4096 --rounds 3"""

from benchmarks import memory

if __name__ == "__main__":
    memory.heap_main(__doc__)
