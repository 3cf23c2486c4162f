"""Errors raised by ``ds_ring.comm`` when a transfer does not complete.

Both name who was waiting (``rank``), on whom (``peer``, a global rank; ``-1`` for a whole
collective) and where (``op``, ``step``), so a hang in a ring of many ranks points at one link.
When the job spans several hosts they also name the host of the rank and of the peer, given to them
(:func:`ds_ring.comm.hosts.name_hosts`). After either error the process group is unusable:
tear it down rather than retry.
"""

from __future__ import annotations

__all__ = ["CommError", "CommTimeoutError"]


class CommError(RuntimeError):
    """A transfer failed before its deadline (typically: the peer crashed or left the group).

    ``what`` says what this rank was doing, e.g. ``"waiting for recv from rank 1"`` or
    ``"posting send to rank 2 / recv from rank 0"``; ``cause`` is the backend's message.
    """

    _MESSAGE = "ds_ring: {who} failed {what} {where}: {cause}; the peer probably crashed or left the group"
    _LAST = "cause"
    """The constructor's argument after ``what`` (pickling passes it back)."""

    def __init__(
        self, rank: int, peer: int, step: int, op: str, what: str, cause: str, hosts: tuple[str, str] | None = None
    ) -> None:
        self.rank = rank
        self.peer = peer
        self.step = step
        self.op = op
        self.what = what
        self.cause = cause
        self.hosts = hosts
        """``(this rank's host, the peer's host)`` when the job spans several hosts (``""``: unknown), else ``None``."""
        super().__init__(self._describe())

    def on_hosts(self, hosts: tuple[str, str]) -> None:
        """Name ``hosts`` (this rank's, the peer's) in the error from now on."""
        self.hosts = hosts
        self.args = (self._describe(),)

    def doing(self, what: str) -> CommError:
        """The same error (same class, hosts and cause), saying this rank was doing ``what``."""
        cls, fields = self.__reduce__()
        return cls(*fields[:4], what, *fields[5:])

    def _who(self) -> str:
        return f"rank {self.rank}" + (f" on {self.hosts[0]}" if self.hosts and self.hosts[0] else "")

    def _where(self) -> str:
        peer_host = f"; rank {self.peer} is on {self.hosts[1]}" if self.hosts and self.hosts[1] else ""
        return f"(op={self.op}, step={self.step}{peer_host})"

    def _describe(self) -> str:
        return self._MESSAGE.format(who=self._who(), where=self._where(), **vars(self))

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        last = getattr(self, self._LAST)
        return type(self), (self.rank, self.peer, self.step, self.op, self.what, last, self.hosts)


class CommTimeoutError(CommError):
    """A transfer did not complete within ``timeout_s`` seconds."""

    _MESSAGE = "ds_ring: {who} timed out after {timeout_s} s {what} {where}; the peer is slow, hung or dead"
    _LAST = "timeout_s"

    def __init__(
        self,
        rank: int,
        peer: int,
        step: int,
        op: str,
        what: str,
        timeout_s: float,
        hosts: tuple[str, str] | None = None,
    ) -> None:
        self.timeout_s = float(timeout_s)
        super().__init__(rank, peer, step, op, what, f"no completion within {self.timeout_s} s", hosts)
