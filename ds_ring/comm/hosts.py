"""Which host every rank of the job runs on: gathered once when a :class:`~ds_ring.Topology` is built.

A rank's host is its ``socket.gethostname()``. The table is a fact of the job, not configuration: it is
read by communication errors (which then name the host of the waiting rank and of its peer, when the
job spans several hosts) and by the Topology's placement check (:mod:`ds_ring.placement`).
"""

from __future__ import annotations

import socket

import torch.distributed as dist

__all__ = ["node_name", "gather_hosts", "host_of", "hosts_of", "spans_hosts"]

_hosts: tuple[str, ...] = ()
"""Host of every global rank, in rank order (empty before the first gather)."""


def node_name() -> str:
    """This process's host: ``socket.gethostname()``."""
    return socket.gethostname()


def gather_hosts(group: dist.ProcessGroup | None, timeout_s: float | None) -> tuple[str, ...]:
    """Every rank's host in rank order (one all-gather over ``group``, a group of every rank whose backend
    takes CPU tensors), remembered for :func:`host_of`. Collective: every rank calls it at the same point."""
    global _hosts
    from ds_ring.comm.agree import gather_texts  # agree imports the collectives, which import the errors

    _hosts = tuple(row[0] for row in gather_texts([node_name()], group=group, op="Topology hosts", timeout_s=timeout_s))
    return _hosts


def spans_hosts() -> bool:
    """Whether the job's ranks run on more than one host (as far as :func:`gather_hosts` has found)."""
    return len(set(_hosts)) > 1


def host_of(rank: int) -> str | None:
    """The host of global ``rank``; ``None`` when unknown (no topology built yet, or a rank outside it)."""
    return _hosts[rank] if 0 <= rank < len(_hosts) else None


def hosts_of(ranks: list[int] | tuple[int, ...]) -> str:
    """``"0, 1 on node0; 2, 3 on node1"``: ``ranks`` grouped by host, or just the ranks when the job runs on
    one host (or the hosts are not known yet)."""
    if not spans_hosts():
        return ", ".join(map(str, ranks))
    by_host: dict[str, list[int]] = {}
    for rank in ranks:
        by_host.setdefault(host_of(rank) or "an unknown host", []).append(rank)
    return "; ".join(f"{', '.join(map(str, members))} on {host}" for host, members in by_host.items())
