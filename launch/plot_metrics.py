"""Plot the per-step metrics ds_ring wrote through DeepSpeed's CSV monitor.

    python launch/plot_metrics.py runs/train/monitor/cpu_default --out runs/train/metrics.png

The directory is ``<csv_monitor.output_path>/<csv_monitor.job_name>``; it holds one
``ds_ring_<metric>_<min|max>.csv`` per metric (``step,<value>`` rows). A resumed run appends to the
same files, repeating its header and the steps it re-ran: the last value written for a step wins.
One panel per quantity; each line is the max over ranks, the band down to the min.
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

PANELS = (
    ("time per step (ms)", ("step_ms", "attention_ms", "attention_compute_ms", "comm_ms", "comm_wait_ms")),
    ("communication hidden behind compute", ("comm_hidden_share",)),
    ("bytes per step (MiB)", ("sent_bytes", "received_bytes")),
    ("peak memory (MiB)", ("peak_memory_mib",)),
    ("loss (rank 0)", ("loss",)),
)
SCALE = {"sent_bytes": 2**-20, "received_bytes": 2**-20}

__all__ = ["read_series", "read_metrics", "plot_metrics"]


def read_series(path: Path) -> dict[int, float]:
    """``{step: value}`` from one CSV monitor file (header rows skipped, later rows win)."""
    series: dict[int, float] = {}
    with open(path, newline="") as handle:
        for row in csv.reader(handle):
            if len(row) == 2 and row[0] != "step":
                series[int(float(row[0]))] = float(row[1])
    return series


def read_metrics(directory: Path) -> dict[str, dict[int, float]]:
    """Every ``ds_ring_*.csv`` of ``directory`` as ``{"<metric>_<min|max>" or "<scalar>": {step: value}}``."""
    files = sorted(directory.glob("ds_ring_*.csv"))
    if not files:
        raise SystemExit(f"plot_metrics: no ds_ring_*.csv in {directory} (is csv_monitor enabled, metrics on?)")
    return {path.stem.removeprefix("ds_ring_"): read_series(path) for path in files}


def plot_metrics(metrics: dict[str, dict[int, float]], out: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(len(PANELS), 1, figsize=(8, 2.6 * len(PANELS)), sharex=True)
    for axis, (label, names) in zip(axes, PANELS, strict=True):
        for name in names:
            high = metrics.get(f"{name}_max", metrics.get(name, {}))  # a scalar (loss) has no min / max
            low = metrics.get(f"{name}_min", high)
            steps = sorted(high)
            if not steps:
                continue
            scale = SCALE.get(name, 1.0)
            top = [high[s] * scale for s in steps]
            bottom = [low.get(s, math.nan) * scale for s in steps]
            (line,) = axis.plot(steps, top, marker=".", label=name)
            axis.fill_between(steps, bottom, top, color=line.get_color(), alpha=0.25, linewidth=0)
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small", loc="best")
    axes[-1].set_xlabel("training step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(title or "ds_ring per-step metrics (line: max over ranks, band: min to max)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory", type=Path, help="<csv_monitor.output_path>/<csv_monitor.job_name>")
    p.add_argument("--out", type=Path, default=None, help="PNG path (default: DIRECTORY/metrics.png)")
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    out = args.out or args.directory / "metrics.png"
    metrics = read_metrics(args.directory)
    plot_metrics(metrics, out, args.title)
    steps = sorted(set().union(*metrics.values()))
    print(f"{out}: {len(metrics)} series, steps {steps[0]}..{steps[-1]}")


if __name__ == "__main__":
    main()
