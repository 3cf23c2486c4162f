"""Errors raised by ``ds_ring.comm`` when a transfer does not complete.

Both name who was waiting (``rank``), on whom (``peer``, a global rank; ``-1`` for a whole
collective) and where (``op``, ``step``), so a hang in a ring of many ranks points at one link.
After either error the process group is unusable: tear it down rather than retry.
"""

from __future__ import annotations

__all__ = ["CommError", "CommTimeoutError"]


class CommError(RuntimeError):
    """A transfer failed before its deadline (typically: the peer crashed or left the group).

    ``what`` says what this rank was doing, e.g. ``"waiting for recv from rank 1"`` or
    ``"posting send to rank 2 / recv from rank 0"``; ``cause`` is the backend's message.
    """

    def __init__(self, rank: int, peer: int, step: int, op: str, what: str, cause: str) -> None:
        self.rank = rank
        self.peer = peer
        self.step = step
        self.op = op
        self.what = what
        self.cause = cause
        super().__init__(self._describe())

    def _describe(self) -> str:
        return (
            f"ds_ring: rank {self.rank} failed {self.what} (op={self.op}, step={self.step}): "
            f"{self.cause}; the peer probably crashed or left the group"
        )

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return type(self), (self.rank, self.peer, self.step, self.op, self.what, self.cause)


class CommTimeoutError(CommError):
    """A transfer did not complete within ``timeout_s`` seconds."""

    def __init__(self, rank: int, peer: int, step: int, op: str, what: str, timeout_s: float) -> None:
        self.timeout_s = float(timeout_s)
        super().__init__(rank, peer, step, op, what, cause=f"no completion within {self.timeout_s} s")

    def _describe(self) -> str:
        return (
            f"ds_ring: rank {self.rank} timed out after {self.timeout_s} s {self.what} "
            f"(op={self.op}, step={self.step}); the peer is slow, hung or dead"
        )

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return type(self), (self.rank, self.peer, self.step, self.op, self.what, self.timeout_s)
