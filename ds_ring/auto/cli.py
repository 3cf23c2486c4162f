"""``python -m ds_ring.auto``: what ``strategy="auto"`` would choose, before any run (no distributed init).

Prints the chosen option — strategy, layout, degrees (``ulysses × ring``), ring chunk — and every
alternative with its predicted step time (compute + exposed communication) and memory per rank (bytes
and q-shards), the refused ones with the strategy's reason::

    python -m ds_ring.auto --config ds_config.json --seq 131072 --heads 32 --kv-heads 8 --head-dim 128 --world 8
    python -m ds_ring.auto --seq 65536 --heads 8 --head-dim 64 --world 4 --dtype float32 --device cpu

The ``ring_attention`` section of ``--config`` supplies the branches, causal, window, layout and
communication (``--layout any`` / no ``ulysses_degree`` in the section: every layout / factorisation is
considered; a section that fixes them is honoured). The link and FLOP rate are ``--latency-us``,
``--bandwidth-gbs``, ``--tflops`` (default: rough rates for ``--device``); at run time ``auto`` measures them.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any

from ds_ring.auto.model import Link, Problem, format_table, plan_options
from ds_ring.auto.strategy import Auto

__all__ = ["main", "problem_from_args"]

_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def _section(path: str | None) -> dict[str, Any]:
    if path is None:
        return {}
    from ds_ring.config import SECTION, read_ds_config

    return dict(read_ds_config(path).get(SECTION, {}))


def _ints(values: Any) -> tuple[int, ...] | None:
    return None if values is None else tuple(int(v) for v in values)


def problem_from_args(args: argparse.Namespace) -> Problem:
    """The :class:`Problem` of the command line and the config's section (command line wins)."""
    section = _section(args.config)
    world = args.world
    ulysses, ring = section.get("ulysses_degree"), section.get("ring_degree")
    degrees = None
    if section.get("strategy", Auto.name) != Auto.name or ulysses is not None or ring is not None:
        u = ulysses or (world // ring if ring else 1)
        degrees = ((1, world), (u, world // u)) if world % u == 0 else ((1, world),)
    layout = args.layout or section.get("layout", "any")
    segments = args.segment_lengths or section.get("segment_lengths")
    rates = args.dilation_rates or section.get("dilation_rates")
    return Problem(
        seq=args.seq, heads=args.heads, kv_heads=args.kv_heads or args.heads, head_dim=args.head_dim, world=world,
        v_head_dim=args.v_head_dim, batch=args.batch, itemsize=_ITEMSIZE[args.dtype],
        causal=section.get("causal", True) if args.causal is None else args.causal,
        window=args.window if args.window is not None else section.get("window"),
        segment_lengths=_ints(segments), dilation_rates=_ints(rates), backward=not args.forward_only,
        ranks_per_host=args.ranks_per_host, layouts=("contiguous", "zigzag") if layout == "any" else (layout,),
        degrees=degrees, communication=args.communication or section.get("communication"),
        memory_limit=None if args.memory_gib is None else int(args.memory_gib * 2**30),
        oversubscription=args.oversubscription if args.device == "cpu" else 1.0,
    )  # fmt: skip


def _link(args: argparse.Namespace) -> Link:
    link = Link.default(args.device)
    fields = {}
    if args.latency_us is not None:
        fields["latency_s"] = args.latency_us * 1e-6
    if args.bandwidth_gbs is not None:
        fields["bandwidth"] = args.bandwidth_gbs * 1e9
    if args.tflops is not None:
        fields["flops"] = args.tflops * 1e12
    return replace(link, source="given", **fields) if fields else link


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ds_ring.auto", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--config", help="ds_config (JSON or YAML) whose ring_attention section to read")
    p.add_argument("--seq", type=int, required=True, help="global sequence length (tokens)")
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--kv-heads", type=int, default=None, help="K/V heads (default: --heads)")
    p.add_argument("--head-dim", type=int, required=True)
    p.add_argument("--v-head-dim", type=int, default=None)
    p.add_argument("--world", type=int, required=True, help="sequence-parallel ranks")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(_ITEMSIZE), default="bfloat16")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda", help="default rates for this device")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--window", type=int, default=None)
    p.add_argument("--segment-lengths", type=int, nargs="+", default=None)
    p.add_argument("--dilation-rates", type=int, nargs="+", default=None)
    p.add_argument("--layout", choices=["contiguous", "zigzag", "any"], default=None)
    p.add_argument("--communication", default=None)
    p.add_argument("--ranks-per-host", type=int, default=None)
    p.add_argument(
        "--oversubscription",
        type=float,
        default=1.0,
        help="CPU ranks: compute threads per core of the busiest machine (ranks x threads / cores)",
    )
    p.add_argument("--forward-only", action="store_true")
    p.add_argument("--memory-gib", type=float, default=None, help="memory per rank an option may use")
    p.add_argument("--latency-us", type=float, default=None)
    p.add_argument("--bandwidth-gbs", type=float, default=None, help="GB/s one rank sends")
    p.add_argument("--tflops", type=float, default=None, help="attention TFLOP/s of one rank")
    p.add_argument("--json", action="store_true", help="print the options as JSON instead of a table")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    problem, link = problem_from_args(args), _link(args)
    options = plan_options(problem, link)
    if args.json:
        rows = [{**o.__dict__, "time_s": o.time_s, "label": o.label} for o in options]
        print(json.dumps({"link": link.__dict__, "options": rows}, indent=1, default=str))
    else:
        print(format_table(problem, options, link))
        if options and options[0].error is None:
            best = options[0]
            print(f"\nchoice: strategy {best.strategy!r}, layout {best.layout!r}, ulysses_degree {best.ulysses}, "
                  f"ring_degree {best.ring}, chunk {best.chunk} rows, predicted {best.time_s * 1e3:.2f} ms/step, "
                  f"{best.memory_bytes / 2**20:.1f} MiB ({best.memory_q_shards:.2f} q-shards) per rank")  # fmt: skip
    return 0 if options and options[0].error is None else 1


if __name__ == "__main__":
    sys.exit(main())
