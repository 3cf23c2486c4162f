"""Ring dilated attention on a long random sequence, sharded over CPU ranks.

Spawns ``--ranks`` processes (gloo, file rendezvous, 127.0.0.1 only), gives each its shard of a
``--seq``-token sequence, runs forward+backward of ring dilated attention, and prints per rank
the time and the peak resident memory. Each rank creates only its own shard, so the memory shown
is what a rank needs. With ``--check`` every rank also builds the full sequence and rank 0 compares
the gathered output with single-process ``ds_ring.dilated_attention``.

Before it starts, the demo prints the memory it predicts per rank — the process, plus
``(4 + E) × q-shard + fixed`` with ``E`` and ``fixed`` measured by ``benchmarks/memory.py`` — and
refuses a run whose ranks together would not fit the machine's available memory, naming the
longest sequence that would.

    python launch/demo.py --seq 65536 --ranks 2 --check
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ds_ring

MIB = 2**20
PROCESS_MIB = 260.0
"""Resident memory of a rank after importing torch and ds_ring and joining gloo, MiB."""
ACTIVATIONS = {"dilated": (5.3, 29.0), "dense": (5.7, 51.0)}
"""Per kind of attention: the slope ``E`` (q-shards) and the fixed MiB of one fwd+bwd per rank, measured
by ``python -m benchmarks.memory`` at 4 ranks (``benchmarks/results/memory.json``)."""


def predicted_rank_mib(args: argparse.Namespace, seq: int) -> float:
    """Peak resident MiB of one rank: the process, q/k/v/dout (4 q-shards), ``E`` q-shards and the fixed part.

    With ``--check`` each rank also holds the full q, k and v (``3 × ranks`` q-shards).
    """
    dense = all(r == 1 for r in args.rates) and max(args.segments) >= seq
    slope, fixed = ACTIVATIONS["dense" if dense else "dilated"]
    shard_mib = seq // args.ranks * args.heads * args.head_dim * 4 / MIB  # fp32
    shards = 4 + slope + (3 * args.ranks if args.check else 0)
    return PROCESS_MIB + shards * shard_mib + fixed


def _available_mib() -> float:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) / 1024


def _longest_fitting(args: argparse.Namespace, budget_mib: float) -> int:
    """The longest sequence, a multiple of ``1024 × ranks`` tokens, whose ranks together fit ``budget_mib``."""
    step = 1024 * args.ranks
    low, high = 0, 1
    while args.ranks * predicted_rank_mib(args, high * step) <= budget_mib:
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if args.ranks * predicted_rank_mib(args, mid * step) <= budget_mib else (low, mid)
    return low * step


def check_memory(args: argparse.Namespace) -> None:
    """Print the prediction; exit with a message when ``ranks ×`` the per-rank peak exceeds the available memory."""
    per_rank = predicted_rank_mib(args, args.seq)
    total, available = args.ranks * per_rank / 1024, _available_mib()
    print(
        f"predicted peak per rank: {per_rank / 1024:.2f} GiB ({args.ranks} ranks: {total:.1f} GiB; "
        f"available: {available / 1024:.1f} GiB)"
    )
    if args.ranks * per_rank > available:
        raise SystemExit(
            f"launch/demo.py: {args.seq} tokens over {args.ranks} ranks needs about {total:.1f} GiB "
            f"but {available / 1024:.1f} GiB is available; the kernel would kill a rank for memory. "
            f"Use --seq {_longest_fitting(args, available)} or less (or more memory)."
        )


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rank(rank: int, args: argparse.Namespace, init_file: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.ranks, timeout=timedelta(seconds=300)
    )
    try:
        if args.check:
            g = torch.Generator().manual_seed(0)
            full = [torch.randn(1, args.seq, args.heads, args.head_dim, generator=g) for _ in range(3)]
            local = [ds_ring.shard_sequence(x).requires_grad_() for x in full]
        else:
            g = torch.Generator().manual_seed(rank)
            shape = (1, args.seq // args.ranks, args.heads, args.head_dim)
            local = [torch.randn(shape, generator=g, requires_grad=True) for _ in range(3)]
        kwargs = dict(causal=True, communication=args.communication)
        start = time.perf_counter()
        out = ds_ring.ring_dilated_attention(*local, args.segments, args.rates, **kwargs)
        forward_s = time.perf_counter() - start
        out.sum().backward()
        total_s = time.perf_counter() - start
        report = torch.tensor([forward_s, total_s, _peak_rss_mib()], dtype=torch.float64)
        reports = [torch.zeros_like(report) for _ in range(args.ranks)]
        dist.all_gather(reports, report)
        gathered = ds_ring.gather_sequence(out.detach()) if args.check else None
        if rank == 0:
            print(
                f"ring dilated attention: {args.seq} tokens over {args.ranks} ranks ({args.seq // args.ranks} each), "
                f"w={args.segments} r={args.rates}, causal, {args.communication}"
            )
            for r, (fwd, both, rss) in enumerate(reports):
                print(f"  rank {r}: forward {fwd:6.2f} s | forward+backward {both:6.2f} s | peak RSS {rss:7.1f} MiB")
            if args.check:
                reference = ds_ring.dilated_attention(*full, args.segments, args.rates, causal=True)
                print(f"  max |ring - single-process| = {(gathered - reference).abs().max().item():.2e}")
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=65536, help="total tokens")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--segments", type=int, nargs="+", default=[2048, 8192, 65536])
    parser.add_argument("--rates", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--communication", choices=["ring", "allgather"], default="ring")
    parser.add_argument("--check", action="store_true", help="compare with single-process attention")
    args = parser.parse_args()
    check_memory(args)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(args, os.path.join(tmp, "rendezvous")), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
