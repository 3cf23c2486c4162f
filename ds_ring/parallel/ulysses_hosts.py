"""Where a Topology's Ulysses groups fall on the job's hosts.

Ulysses runs two all-to-alls per attention layer over its group: inside one host they take the fast
local links, across hosts every layer waits on the network. The rank layout puts the Ulysses dimension
innermost (consecutive ranks) and launchers give each host consecutive ranks, so Ulysses groups stay
inside a host whenever ``ulysses_degree`` divides the ranks per host; :func:`check_placement` finds the
groups that do not, from every rank's host (:func:`gather_hosts`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch.distributed as dist

from ds_ring.comm import cores
from ds_ring.comm import hosts as job_hosts
from ds_ring.comm.agree import gather_texts
from ds_ring.parallel.layout import RankLayout

__all__ = ["PLACEMENT_MODES", "PlacementWarning", "gather_hosts", "ulysses_across_hosts", "check_placement"]

PLACEMENT_MODES = ("warn", "error", "allow")
"""What a Ulysses group spanning several hosts does: a :class:`PlacementWarning`, a ``ValueError``, nothing."""


class PlacementWarning(UserWarning):
    """A Ulysses group spans several hosts."""


def gather_hosts(
    group: dist.ProcessGroup | None, timeout_s: float | None
) -> tuple[tuple[str, ...], tuple[cores.CpuPlace, ...]]:
    """Every rank's host and CPU place (:class:`ds_ring.comm.cores.CpuPlace`) in rank order: one all-gather over
    ``group``, a group of every rank whose backend takes CPU tensors. Collective: every rank calls it at the same
    point. The Topology keeps them, and the job's first records them (:meth:`ds_ring.comm.job.Job.record_facts`:
    communication errors name the hosts from then on)."""
    mine = [job_hosts.node_name(), cores.this_place().to_text()]
    rows = gather_texts(mine, group=group, op="Topology hosts", timeout_s=timeout_s)
    return tuple(row[0] for row in rows), tuple(cores.CpuPlace.from_text(row[1]) for row in rows)


def ulysses_across_hosts(layout: RankLayout, hosts: Sequence[str]) -> list[tuple[int, ...]]:
    """The Ulysses groups of ``layout`` whose ranks run on more than one host (``hosts[rank]``)."""
    return [ranks for ranks in layout.groups("ulysses") if len({hosts[r] for r in ranks}) > 1]


def check_placement(layout: RankLayout, hosts: Sequence[str], mode: str = "warn") -> str | None:
    """Warn about (``"warn"``), refuse (``"error"``) or allow (``"allow"``) Ulysses groups spanning hosts.

    Returns the message (``None`` when every Ulysses group is inside one host, or with ``"allow"``).

    Raises:
        ValueError: ``mode`` is not one of :data:`PLACEMENT_MODES`, or it is ``"error"`` and a group spans
            hosts (the message names the ranks and hosts of each such group, and the fix).
    """
    if mode not in PLACEMENT_MODES:
        raise ValueError(f"ulysses_across_hosts must be one of {list(PLACEMENT_MODES)}, got {mode!r}")
    crossing = ulysses_across_hosts(layout, hosts)
    if not crossing or mode == "allow":
        return None
    per_host: dict[str, int] = {}
    for host in hosts:
        per_host[host] = per_host.get(host, 0) + 1
    per_node = math.gcd(*per_host.values())
    fits = max(d for d in range(1, layout.ulysses + 1) if layout.ulysses % d == 0 and per_node % d == 0)
    shown = "; ".join(f"ranks {list(ranks)} on {_by_host(ranks, hosts)}" for ranks in crossing[:4])
    more = f" (and {len(crossing) - 4} more)" if len(crossing) > 4 else ""
    sp = layout.sequence_parallel
    message = (
        f"ds_ring: {len(crossing)} Ulysses group(s) of ulysses_degree {layout.ulysses} span several hosts: {shown}"
        f"{more}; their all-to-alls cross the network in every attention layer. Choose a ulysses_degree that "
        f"divides the ranks per host ({per_node}), with the ring across hosts (e.g. "
        f"ulysses_degree {fits} × ring_degree {sp // fits}), launch the same number of consecutive ranks on every "
        f'host, or set ring_attention.ulysses_across_hosts to "allow"'
    )
    if mode == "error":
        raise ValueError(message)
    warnings.warn(message, PlacementWarning, stacklevel=3)
    return message


def _by_host(ranks: tuple[int, ...], hosts: Sequence[str]) -> str:
    by_host: dict[str, list[int]] = {}
    for rank in ranks:
        by_host.setdefault(hosts[rank], []).append(rank)
    return ", ".join(f"{host} ({', '.join(map(str, members))})" for host, members in by_host.items())
