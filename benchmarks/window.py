"""One sliding-window layer's forward+backward on a CPU: the band kernels side by side (issue 33, defect 7).

``python -m benchmarks.window [--seq 16384] [--rounds 3] [--out DIR]``: fp32, batch 1, 8 heads × 64, window 128,
2 threads, ``ds_ring.dilated_attention(q, k, v, causal=True, window=128)`` then ``backward``. Variants:

- ``pieces``: the kernel before the batched bands (a Python loop over band pieces fed to ``cpu_flash``; its
  ``window.py`` read from git at :data:`PIECES_REV`);
- ``batched``: the batched bands computing the scores themselves (masked matmuls, softmax, grouped by
  ``BAND_BYTES``): what :mod:`ds_ring.kernels.window` runs off the CPU;
- ``fused``: the batched bands through the fused CPU flash kernel (the CPU default).

Each (round, variant) is a fresh process, the variants' order alternating between rounds: it warms up on 256
tokens, reads its peak RSS (inputs and ``dout`` made), runs the call once (its *extra* peak RSS, MiB and in q
shards) and once more timed (wall seconds), and counts the call's ops (:class:`tests.op_count.OpCount`). The
median over rounds, the load average before and after, go to ``DIR/window.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

PIECES_REV = "650ed12^"
"""The commit before the batched bands: its ``ds_ring/kernels/window.py`` is the ``pieces`` variant."""
VARIANTS = ("pieces", "batched", "fused")
HEADS, DIM, WINDOW = 8, 64, 128

_WORKER = textwrap.dedent(
    """
    import json, resource, sys, time, types, torch
    import ds_ring
    from ds_ring.kernels import dilated, window as W
    from tests.op_count import OpCount
    variant, seq, heads, dim, window = sys.argv[1], *map(int, sys.argv[2:6])
    torch.set_num_threads(2)
    if variant == "pieces":
        old = sys.modules["pieces_window"] = types.ModuleType("pieces_window")  # dataclasses look it up
        exec(compile(sys.stdin.read(), "pieces_window.py", "exec"), old.__dict__)
        dilated.attend_band_into, dilated.attend_band_backward = old.attend_band_into, old.attend_band_backward
    elif variant == "batched":
        W._fused = lambda *args: False

    def layer(q, k, v, dout):
        ds_ring.dilated_attention(q, k, v, causal=True, window=window).backward(dout)

    small = [torch.randn(1, 256, heads, dim, requires_grad=True) for _ in range(3)]
    layer(*small, torch.randn(1, 256, heads, dim))
    q, k, v = (torch.randn(1, seq, heads, dim, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, seq, heads, dim)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    layer(q, k, v, dout)
    extra = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    for x in (q, k, v):
        x.grad = None
    start = time.perf_counter()
    layer(q, k, v, dout)
    seconds = time.perf_counter() - start
    for x in (q, k, v):
        x.grad = None
    with OpCount() as ops:
        layer(q, k, v, dout)
    q_shard = q.numel() * q.element_size() / 2**20
    print(json.dumps({"seconds": seconds, "extra_mib": extra, "extra_q_shards": extra / q_shard, "ops": ops.total}))
    """
)


def _one(variant: str, seq: int, pieces_src: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "2"}
    done = subprocess.run(
        [sys.executable, "-c", _WORKER, variant, str(seq), str(HEADS), str(DIM), str(WINDOW)],
        input=pieces_src if variant == "pieces" else "", capture_output=True, text=True, env=env,
    )  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"{variant} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    pieces_src = subprocess.run(
        ["git", "show", f"{PIECES_REV}:ds_ring/kernels/window.py"], capture_output=True, text=True, check=True
    ).stdout
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {name: [] for name in args.variants}
    for r in range(args.rounds):
        order = args.variants if r % 2 == 0 else args.variants[::-1]
        for name in order:
            runs[name].append(_one(name, args.seq, pieces_src))
            print(f"round {r} {name}: {runs[name][-1]}", flush=True)
    result = {
        "seq": args.seq, "heads": HEADS, "head_dim": DIM, "window": WINDOW, "dtype": "float32", "threads": 2,
        "rounds": args.rounds, "load_before": load_before, "load_after": os.getloadavg(),
        "variants": {
            name: {
                "median_seconds": statistics.median(x["seconds"] for x in rs),
                "seconds": [x["seconds"] for x in rs],
                "extra_mib": statistics.median(x["extra_mib"] for x in rs),
                "extra_q_shards": statistics.median(x["extra_q_shards"] for x in rs),
                "ops": rs[0]["ops"],
            }
            for name, rs in runs.items()
        },
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "window.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
