"""One sliding-window layer's forward+backward on a CPU: the band kernels side by side (issue 33, defect 7).
``python -m benchmarks.window [--seq 16384] [--rounds 3] [--out DIR]``, medians in ``DIR/window.json`` (SUITE.md)."""

import argparse
import os
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import MIB, RESULTS, max_rss_bytes, write_json
from ds_ring.testing import rank_results, spawn_ranks

PIECES_REV = "650ed12^"  # the commit before the batched bands: its ds_ring/kernels/window.py is the "pieces" variant
VARIANTS = ("pieces", "batched", "fused")
HEADS, DIM, WINDOW, THREADS = 8, 64, 128, 2


def _with_piece(band: Callable) -> Callable:
    """A band function of the ``pieces`` revision (options as keywords) called as the kernels call theirs now:
    tensors, then a :class:`~ds_ring.kernels.piece.Piece`."""

    def call(*args: Any) -> Any:
        *tensors, piece = args
        return band(*tensors, d=piece.d, window=piece.window, scale=piece.scale, softcap=piece.softcap)

    return call


def _variant(rank: int, world: int, variant: str, seq: int, pieces_src: str) -> dict:
    """In a fresh process: warm up on 256 tokens, then the layer once (its extra peak RSS), once timed, once counted."""
    import torch

    import ds_ring
    from ds_ring.kernels import dilated
    from ds_ring.kernels import window as W
    from tests.op_count import OpCount

    if variant == "pieces":
        old = sys.modules["pieces_window"] = types.ModuleType("pieces_window")  # dataclasses look it up
        exec(compile(pieces_src, "pieces_window.py", "exec"), old.__dict__)
        dilated.attend_band_into, dilated.attend_band_backward = map(
            _with_piece, (old.attend_band_into, old.attend_band_backward)
        )
    elif variant == "batched":
        W._fused = lambda *args: False

    def layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor) -> None:
        for x in (q, k, v):
            x.grad = None
        ds_ring.dilated_attention(q, k, v, causal=True, window=WINDOW).backward(dout)

    shards = lambda n: [torch.randn(1, n, HEADS, DIM, requires_grad=i < 3) for i in range(4)]
    layer(*shards(256))
    q, k, v, dout = shards(seq)
    base = max_rss_bytes()
    layer(q, k, v, dout)
    extra = (max_rss_bytes() - base) / MIB
    start = time.perf_counter()
    layer(q, k, v, dout)
    seconds = time.perf_counter() - start
    with OpCount() as ops:
        layer(q, k, v, dout)
    q_shard = q.numel() * q.element_size() / MIB
    return {"seconds": seconds, "extra_mib": extra, "extra_q_shards": extra / q_shard, "ops": ops.total}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    pieces_src = subprocess.run(
        ["git", "show", f"{PIECES_REV}:ds_ring/kernels/window.py"], capture_output=True, text=True, check=True
    ).stdout
    os.environ["OMP_NUM_THREADS"] = str(THREADS)  # read by the fork server the ranks come from
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {name: [] for name in args.variants}
    for r in range(args.rounds):
        for name in args.variants if r % 2 == 0 else args.variants[::-1]:
            outcomes = spawn_ranks(_variant, 1, timeout_s=1800, args=(name, args.seq, pieces_src),
                                   threads_per_rank=THREADS, process_group=False)  # fmt: skip
            runs[name] += rank_results(outcomes)
            print(f"round {r} {name}: {runs[name][-1]}", flush=True)
    median = lambda rs, key: statistics.median(x[key] for x in rs)
    write_json(args.out / "window.json", {
        "seq": args.seq, "heads": HEADS, "head_dim": DIM, "window": WINDOW, "dtype": "float32", "threads": THREADS,
        "rounds": args.rounds, "load_before": load_before, "load_after": os.getloadavg(),
        "variants": {name: {"median_seconds": median(rs, "seconds"), "seconds": [x["seconds"] for x in rs],
                            "extra_mib": median(rs, "extra_mib"), "extra_q_shards": median(rs, "extra_q_shards"),
                            "ops": rs[0]["ops"]} for name, rs in runs.items()},
    })  # fmt: skip
    print((args.out / "window.json").read_text())


if __name__ == "__main__":
    main(sys.argv[1:])
