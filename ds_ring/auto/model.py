"""The cost and memory model behind ``strategy="auto"``: pure arithmetic on numbers every rank knows.

For one attention call (fwd+bwd) over ``p`` sequence-parallel ranks, every registered strategy offers its *options*
(:meth:`~ds_ring.strategies.Strategy.options`: layout, exchange, degrees ``ulysses × ring``, the rows of one ring
block) and predicts, per rank (its own module's model, :mod:`ds_ring.strategies.cost`):

- **compute**: attention FLOPs per rank over the agreed FLOP rate (a LongNet branch ``(w, r)`` has ``S·w/r²``
  query-key pairs per head, ``2·(D + Dv)`` FLOPs per pair forward and 2.5× that backward), with a causal
  contiguous ring's imbalance (``strategies/ring.py``);
- **bytes per link** and **exposed communication**: what its exchanges move, over the link's bandwidth plus one
  latency per message, less what its compute hides;
- **memory per rank**, extra over ``q, k, v, dout`` (what :mod:`benchmarks.memory` measures), in q-shards, with
  coefficients fitted on measured runs (:data:`BUFFERS`).

Step time = compute + exposed communication, on the probe's rates calibrated per device type
(:data:`CALIBRATION`, fitted by ``python -m benchmarks.auto_fit``). The choice is the fastest valid option
(validity is the strategies' own :meth:`~ds_ring.strategies.Strategy.check`, so ``auto`` never picks what a strategy
refuses), ties within :data:`TIE` broken by less memory, then by registration order: a pure function of its inputs,
so every rank given the same inputs decides alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ds_ring.strategies.base import AttentionCall, Degrees, Shape, get_strategy, strategy_names
from ds_ring.strategies.cost import CALIBRATION, Calibration, Cost, Link, Option, Problem

__all__ = [
    "Link", "Problem", "Option", "Calibration", "Cost", "plan_options", "choose", "evaluate", "memory_q_shards",
    "BUFFERS", "CALIBRATION", "TIE", "format_table",
]  # fmt: skip

TIE = 0.03
"""Options within 3 % of the fastest step time count as equally fast (then the least memory wins)."""


def _coefficients() -> dict[str, float]:
    merged: dict[str, float] = {}
    for name in strategy_names():
        merged.update(get_strategy(name).buffers)
    return merged


BUFFERS = _coefficients()
"""Every registered strategy's fitted memory coefficients (:attr:`~ds_ring.strategies.Strategy.buffers`), merged
when this module was imported: ``ring``, ``ring_dilated``, ``allgather`` (``strategies/ring.py``), ``ulysses``
(``strategies/ulysses.py``), ``hybrid_ring`` (``strategies/hybrid.py``)."""


def memory_q_shards(p: Problem, o: Option, buffers: dict[str, float] | None = None) -> float:
    """Predicted extra memory per rank of one fwd+bwd (over q, k, v, dout), in q-shards: ``o``'s strategy's model
    (``buffers``: coefficients overriding its own, by name)."""
    return get_strategy(o.strategy).memory_q_shards(p, o, buffers)


def _candidates(p: Problem) -> list[Option]:
    """Every registered strategy's options, once each."""
    seen, unique = set(), []
    for name in strategy_names():
        for o in get_strategy(name).options(p):
            key = (o.strategy, o.communication, o.layout, o.ulysses, o.ring)
            if key not in seen:
                seen.add(key)
                unique.append(o)
    return unique


def _check(p: Problem, o: Option) -> str | None:
    """The strategy's own refusal of ``o`` (``None``: it accepts), via :meth:`Strategy.check`."""
    if p.seq % (p.world * (2 if o.layout == "zigzag" else 1)):
        return f"sequence {p.seq} does not split into {p.world} {o.layout} shards"
    call = AttentionCall(
        segment_lengths=p.segment_lengths, dilation_rates=p.dilation_rates, causal=p.causal,
        communication=o.communication, layout=o.layout, window=p.window, cu_seqlens=p.documents,
    )  # fmt: skip
    shape = Shape(p.batch, p.local, p.heads, p.kv_heads, p.head_dim)
    try:
        get_strategy(o.strategy).check(call, shape, Degrees(o.ulysses, o.ring))
    except ValueError as err:
        return str(err)
    return None


def evaluate(p: Problem, o: Option, link: Link) -> Option:
    """``o`` with its predicted seconds, bytes and memory filled in (and ``error`` when invalid); ``link``: the
    rates to compute with (calibrated)."""
    error = _check(p, o)
    if error is not None:
        return replace(o, error=error)
    strategy = get_strategy(o.strategy)
    cost = strategy.cost(p, o, link)
    q_shards = strategy.memory_q_shards(p, o)
    return replace(
        o, compute_s=cost.compute_s, comm_s=cost.comm_s, exposed_s=cost.exposed_s, sent_bytes=int(cost.sent_bytes),
        memory_q_shards=q_shards, memory_bytes=int(q_shards * p.q_shard_bytes), link=link,
        oversubscription=p.oversubscription,
    )  # fmt: skip


def _rank(p: Problem, options: Sequence[Option]) -> list[Option]:
    """Valid options best first: fastest (ties within :data:`TIE` → less memory → registration order)."""
    valid = [o for o in options if o.error is None]
    fits = [o for o in valid if p.memory_limit is None or o.memory_bytes <= p.memory_limit]
    pool = fits or sorted(valid, key=lambda o: o.memory_bytes)[:1]
    order = {name: i for i, name in enumerate(strategy_names())}

    def key(o: Option) -> tuple:
        return (o.strategy not in order, order.get(o.strategy, 0), o.layout, o.ulysses, o.communication or "")

    by_time = sorted(pool, key=lambda o: (o.time_s, *key(o)))
    if not by_time:
        return []
    best = by_time[0].time_s
    close = sorted((o for o in by_time if o.time_s <= best * (1 + TIE)), key=lambda o: (o.memory_bytes, *key(o)))
    rest = [o for o in by_time if o not in close]
    return close + rest + [o for o in valid if o not in pool]


def plan_options(p: Problem, link: Link, calibration: Calibration | None = None) -> list[Option]:
    """Every candidate option with its predictions: the valid ones best first, then the refused ones. The rates are
    ``link``'s calibrated by ``calibration`` (``None``: :data:`CALIBRATION` of the device it was measured on)."""
    link = link.calibrated(calibration)
    options = [evaluate(p, o, link) for o in _candidates(p)]
    return _rank(p, options) + [o for o in options if o.error is not None]


def choose(p: Problem, link: Link) -> Option:
    """The option ``auto`` runs; ``ValueError`` naming every strategy's refusal when none is valid."""
    options = plan_options(p, link)
    if not options or options[0].error is not None:
        reasons = "; ".join(f"{o.label}: {o.error}" for o in options)
        raise ValueError(f"strategy 'auto' found no valid strategy for this call: {reasons}")
    return options[0]


def format_table(p: Problem, options: Sequence[Option], link: Link) -> str:
    """The options as a fixed-width table (the chosen one first, marked ``*``)."""
    mib = 2**20
    lines = [
        f"seq {p.seq} × {p.heads} heads ({p.kv_heads} K/V) × {p.head_dim}, {p.world} ranks, {p.itemsize}-byte "
        f"elements, causal={p.causal}, q-shard {p.q_shard_bytes / mib:.2f} MiB"
        + (f", CPU oversubscription {p.oversubscription:g}" if p.oversubscription != 1 else ""),
        f"link: latency {link.latency_s * 1e6:.1f} µs, bandwidth {link.bandwidth / 1e9:.2f} GB/s, "
        f"compute {link.flops / 1e12:.3f} TFLOP/s ({link.source})",
        f"  {'option':36s} {'step ms':>9s} {'compute':>9s} {'exposed':>9s} {'MiB sent':>9s} "
        f"{'mem MiB':>9s} {'q-shards':>8s}",
    ]
    for i, o in enumerate(options):
        mark = "*" if i == 0 and o.error is None else " "
        if o.error is not None:
            lines.append(f"{mark} {o.label:36s} refused: {o.error[:90]}")
            continue
        lines.append(
            f"{mark} {o.label:36s} {o.time_s * 1e3:9.2f} {o.compute_s * 1e3:9.2f} {o.exposed_s * 1e3:9.2f} "
            f"{o.sent_bytes / mib:9.1f} {o.memory_bytes / mib:9.1f} {o.memory_q_shards:8.2f}"
        )
    return "\n".join(lines)
