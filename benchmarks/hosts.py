"""One rank of ``benchmarks.auto --two-hosts`` under torchrun (:func:`benchmarks.auto.time_two_hosts`): every grid
point timed in this one launch; rank 0 writes ``OUT/hosts.json``.

    python -m benchmarks.hosts OUT ROUNDS TIMEOUT_S SEQ..."""

import itertools
import json
import sys
from pathlib import Path

import torch.distributed as dist

from benchmarks.auto import GRID_HEADS, HOST_RANKS, grid_cases, interleaved_rank


def main(out: Path, rounds: int, timeout_s: float, seqs: list[int]) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    points = []
    for seq, (heads, kv_heads) in itertools.product(seqs, GRID_HEADS):
        cases = grid_cases(seq, world, 1, heads, kv_heads, ulysses=HOST_RANKS)
        point = {"ranks": world, "data": 1, "hosts": 2, "seq": seq, "heads": heads, "kv_heads": kv_heads}
        points.append({**point, **interleaved_rank(rank, world, cases, rounds, timeout_s)})
    if rank == 0:
        (out / "hosts.json").write_text(json.dumps(points))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), [int(s) for s in sys.argv[4:]])
