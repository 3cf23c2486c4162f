"""Which host every rank of the job runs on: recorded once, by the job's first :class:`~ds_ring.Topology`.

A rank's host is its ``socket.gethostname()``. The table is a fact of the job, like the world size: the
Topology gathers it (:func:`ds_ring.parallel.ulysses_hosts.gather_hosts`) and keeps it, and the first one of a job
records it in the :class:`~ds_ring.comm.job.Job`; :func:`name_hosts` adds the host of the waiting rank and of its
peer to a communication error when the job spans several hosts. Errors themselves read nothing: their hosts are
data given to them.
"""

from __future__ import annotations

import socket

from ds_ring.comm.errors import CommError
from ds_ring.comm.job import job

__all__ = ["node_name", "host_of", "hosts_of", "spans_hosts", "name_hosts"]


def node_name() -> str:
    """This process's host: ``socket.gethostname()``."""
    return socket.gethostname()


def spans_hosts() -> bool:
    """Whether the job's ranks run on more than one host (as far as its first Topology found)."""
    return len(set(job().hosts)) > 1


def host_of(rank: int) -> str | None:
    """The host of global ``rank``; ``None`` when unknown (no topology built yet, or a rank outside it)."""
    hosts = job().hosts
    return hosts[rank] if 0 <= rank < len(hosts) else None


def hosts_of(ranks: list[int] | tuple[int, ...]) -> str:
    """``"0, 1 on node0; 2, 3 on node1"``: ``ranks`` grouped by host, or just the ranks when the job runs on
    one host (or the hosts are not known yet)."""
    if not spans_hosts():
        return ", ".join(map(str, ranks))
    by_host: dict[str, list[int]] = {}
    for rank in ranks:
        by_host.setdefault(host_of(rank) or "an unknown host", []).append(rank)
    return "; ".join(f"{', '.join(map(str, members))} on {host}" for host, members in by_host.items())


def name_hosts(error: CommError) -> CommError:
    """``error``, naming the host of its rank and of its peer when the job spans several hosts."""
    if error.hosts is None and spans_hosts():
        error.on_hosts((host_of(error.rank) or "", host_of(error.peer) or ""))
    return error
