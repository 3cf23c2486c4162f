"""A measured case as a table row (:class:`Row`), lookups and ratios between rows, tables and plots."""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from benchmarks.cases import Case
from benchmarks.common import Series, fmt_seq, plot_panels
from ds_ring import testing

if TYPE_CHECKING:
    from benchmarks.driver import Session

OTHER_CPU_WARN = 0.10  # above this share of the CPUs used by other processes, a case's timings are flagged


@dataclass
class Row:
    """One case's measurements over all ranks, or why it has none (``notes``); the fields: ``benchmarks/*.md``."""

    case: Case
    label: str
    procs: str
    useful_gflop: float
    estimated_call_s: float | None = None
    calls: int | None = None
    fwd_s: float | None = None
    fwdbwd_s: float | None = None
    fwd_peak_mib: float | None = None
    peak_mib: float | None = None
    peak_mib_per_rank: list[float] | None = None
    fwd_first_extra_mib: float | None = None
    first_extra_mib: float | None = None
    inputs_mib: float | None = None
    warmup_max_abs_err: float | None = None
    blocked_s_per_rank: list[float] | None = None
    compute_s_per_rank: list[float] | None = None
    overlap_ratio: float | None = None
    other_cpu_pct: float | None = None
    attempts_other_cpu_pct: list[float | None] = field(default_factory=list)
    loadavg_1m: float | None = None
    launch_wall_s: float | None = None
    notes: list[str] = field(default_factory=list)
    raw: list[dict[str, Any]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float | None:
        return self.case.batch * self.case.seq / self.fwdbwd_s if self.fwdbwd_s else None

    @property
    def gflops(self) -> float | None:
        return self.useful_gflop / self.fwdbwd_s if self.fwdbwd_s else None

    def largest(self, key: str) -> float | None:
        """The largest rank's raw ``key`` (None unless every rank has it)."""
        values = [r.get(key) for r in self.raw]
        return max(values) if values and None not in values else None


def summarize(row: Row, outcomes: list[testing.RankOutcome], wall_s: float, other: float | None) -> None:
    """Fill ``row`` from one launch's outcomes."""
    row.raw = [
        {"rank": o.rank, "error": o.error, "cpu_s": o.cpu_s, "peak_rss_mib": o.peak_rss_mib,
         **(asdict(o.value) if o.ok else {})}
        for o in outcomes
    ]  # fmt: skip
    row.other_cpu_pct = 100.0 * other if other is not None else None
    row.launch_wall_s, row.loadavg_1m, row.notes = wall_s, os.getloadavg()[0], []
    errors = [f"rank {o.rank}: {o.error.strip().splitlines()[-1]}" for o in outcomes if not o.ok]
    if errors:  # a failing rank usually makes its peers fail too: the first error is the cause
        row.notes.append("error: " + errors[0] + (f" (+{len(errors) - 1} more ranks)" if len(errors) > 1 else ""))
    results = [o.value for o in outcomes if o.ok]
    row.notes += sorted({f"skipped: {r.skipped}" for r in results if r.skipped})
    if errors or any(r.fwdbwd is None for r in results):
        return
    fb = [r.fwdbwd for r in results]
    row.calls, row.fwdbwd_s = len(fb[0].times_s), max(t.median_s for t in fb)
    row.peak_mib_per_rank = [r.working_mib(r.fwdbwd) for r in results]
    row.peak_mib, row.first_extra_mib = max(row.peak_mib_per_rank), max(t.first_extra_mib for t in fb)
    row.inputs_mib = max(r.inputs_mib or 0.0 for r in results)
    if all(r.fwd for r in results):
        row.fwd_s = max(r.fwd.median_s for r in results)
        row.fwd_peak_mib = max(r.working_mib(r.fwd) for r in results)
        row.fwd_first_extra_mib = max(r.fwd.first_extra_mib for r in results)
    errs = [r.warmup_max_abs_err for r in results if r.warmup_max_abs_err is not None]
    row.warmup_max_abs_err = max(errs) if errs else None
    if all(r.ring_steps for r in results):
        walls = [sum(t.times_s) for t in fb]
        row.blocked_s_per_rank = [r.blocked_s for r in results]
        row.compute_s_per_rank = [w - r.blocked_s for w, r in zip(walls, results, strict=True)]
        row.overlap_ratio = max(walls) / max(row.compute_s_per_rank) if max(row.compute_s_per_rank) > 0 else None
    if other is not None and other > OTHER_CPU_WARN:
        row.notes.append(f"other processes used {100 * other:.0f}% of the CPUs: timing disturbed")


def find(rows: Iterable[Row], **fields: Any) -> Row | None:
    """The first row whose case has these field values, e.g. ``find(rows, impl="rap", seq=8192, world=2)``."""
    return next((r for r in rows if all(getattr(r.case, k) == v for k, v in fields.items())), None)


def ratio(num: Row | None, den: Row | None, attr: str = "fwdbwd_s") -> float | None:
    """``num.attr ÷ den.attr`` (None when either is missing); a reference's time ÷ a row's = how many times faster."""
    a, b = (getattr(r, attr) if r is not None else None for r in (num, den))
    return a / b if a and b else None


@dataclass(frozen=True)
class Column:
    header: str
    get: Callable[[Row], Any]
    fmt: str | Callable[[Any], str] = "{}"


COLUMNS = {c.header: c for c in [
    Column("impl", lambda r: r.label),
    Column("seq", lambda r: r.case.seq, fmt_seq),
    Column("causal", lambda r: "yes" if r.case.causal else "no"),
    Column("procs × threads", lambda r: r.procs),
    Column("fwd s", lambda r: r.fwd_s, "{:.3f}"),
    Column("fwd+bwd s", lambda r: r.fwdbwd_s, "{:.3f}"),
    Column("tokens/s", lambda r: r.tokens_per_s, "{:.0f}"),
    Column("useful GFLOP/s", lambda r: r.gflops, "{:.1f}"),
    Column("peak MiB/rank", lambda r: r.peak_mib, "{:.1f}"),
    Column("inputs MiB/rank", lambda r: r.inputs_mib, "{:.1f}"),
    Column("wall ÷ compute", lambda r: r.overlap_ratio, "{:.2f}"),
    Column("warm-up err", lambda r: r.warmup_max_abs_err, "{:.1e}"),
    Column("other load %", lambda r: r.other_cpu_pct, "{:.0f}"),
    Column("notes", lambda r: "; ".join(r.notes)),
]}  # fmt: skip


def markdown_table(rows: Sequence[Any], columns: Sequence[Column | str]) -> str:
    """GitHub markdown table; a missing (None) value prints as '—'."""

    def cell(row: Any, col: Column) -> str:
        if (value := col.get(row)) is None or (isinstance(value, float) and math.isnan(value)):
            return "—"
        return col.fmt(value) if callable(col.fmt) else col.fmt.format(value)

    cols = [COLUMNS[c] if isinstance(c, str) else c for c in columns]
    lines = ["| " + " | ".join(c.header for c in cols) + " |", "|" + "---|" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(cell(r, c) for c in cols) + " |" for r in rows])


Figure = tuple[str, str, Sequence[tuple[str, Callable[["Row"], float | None], str]]]  # (file suffix, y label, lines)
TIME: Figure = ("time", "fwd+bwd time per call, slowest rank (s)", [("", lambda r: r.fwdbwd_s, "-o")])
MEMORY: Figure = ("memory", "peak working memory, largest rank (MiB)", [("", lambda r: r.peak_mib, "-o")])


def plot_rows(
    session: Session, panel: Callable[[Row], str | None], title: str,
    figures: Sequence[Figure] = (TIME, MEMORY), logy: bool = True,
) -> None:  # fmt: skip
    """``<out>/<name>_<figure>.png`` per figure against the total length: a panel per ``panel(row)`` (None: left out),
    a line per (label, phase: (suffix, value, matplotlib format)), a colour per label."""
    labels, ticks = list(dict.fromkeys(r.label for r in session.rows)), sorted({r.case.seq for r in session.rows})
    for name, ylabel, phases in figures:
        panels: dict[str, dict[str, Series]] = {}
        for r, (suffix, y, style) in itertools.product(session.rows, phases):
            if panel(r) is not None and y(r) is not None:
                key, color = f"{r.label} {suffix}".strip(), f"C{labels.index(r.label) % 10}"
                s = panels.setdefault(panel(r), {}).setdefault(key, Series(key, style=style, kwargs={"color": color}))
                s.x.append(r.case.seq)
                s.y.append(y(r))
        if items := [(title_, list(series.values())) for title_, series in panels.items()]:
            path, xlabel = session.out / f"{session.bench.name}_{name}.png", "total sequence length"
            plot_panels(path, items, xlabel=xlabel, ylabel=ylabel, title=title, xticks=ticks, logy=logy)
