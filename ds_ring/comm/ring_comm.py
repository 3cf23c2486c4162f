"""Point-to-point ring transfers with double buffering (after ring-flash-attention's ``RingComm``).

A step of a ring queues one or more ``send_recv`` pairs, posts them with ``commit(step)`` (one
``batch_isend_irecv``), computes on the current block while they travel, then ``wait()``s::

    comm = RingComm(group, send_to, recv_from, op="ring_kv")
    for step in range(p):
        if step + 1 < p:
            next_kv = comm.send_recv(kv)
            comm.commit(step)
        out, lse = merge(out, lse, *attend(q, kv))
        if step + 1 < p:
            comm.wait()
            kv = next_kv

Sends and receives are posted together, so neither side blocks the other even when
``send_to == recv_from`` (two ranks): gloo posts each op without blocking, NCCL runs the batch
as one group. Messages between two ranks match in posting order, so every rank must queue its
transfers in the same order (true when all ranks run the same code).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from ds_ring.comm.errors import CommError
from ds_ring.comm.gpu_timing import StreamTiming, mark
from ds_ring.comm.group_ranks import group_rank
from ds_ring.comm.spans import group_members
from ds_ring.comm.wait import Pending, failed, resolve_timeout, stream_ordered, wait_all
from ds_ring.hooks import Event, emit, hooks_active

__all__ = ["RingComm"]


@dataclass(frozen=True)
class _Transfer:
    send: torch.Tensor
    recv: torch.Tensor
    allocated: bool
    """Whether ``send_recv`` allocated the receive tensor (no ``recv_buffer`` given)."""


class _LiveBlocks:
    """Counts received blocks (the tensors received at one commit) that are still referenced.

    Measured with ``weakref.finalize`` on each received tensor object, so it reflects what the
    caller actually keeps; a view kept after its base tensor is dropped is not counted. Only blocks
    received while a hook listens are tracked (the count is for ``recv`` events).
    """

    def __init__(self) -> None:
        self._alive: dict[int, int] = {}  # block index -> number of its tensors still alive
        self._holder: dict[int, tuple[int, weakref.finalize]] = {}  # id(tensor) -> (block, finalizer)

    def add(self, block: int, tensor: torch.Tensor) -> None:
        previous = self._holder.pop(id(tensor), None)
        if previous is not None:  # a reused receive buffer no longer holds its old block
            old_block, finalizer = previous
            finalizer.detach()
            self._release(old_block)
        finalizer = weakref.finalize(tensor, self._drop, id(tensor), block)
        self._holder[id(tensor)] = (block, finalizer)
        self._alive[block] = self._alive.get(block, 0) + 1

    def count(self) -> int:
        return len(self._alive)

    def _drop(self, key: int, block: int) -> None:
        self._holder.pop(key, None)
        self._release(block)

    def _release(self, block: int) -> None:
        left = self._alive[block] - 1
        if left:
            self._alive[block] = left
        else:
            del self._alive[block]


class RingComm:
    """Paired sends to ``send_to`` and receives from ``recv_from``, posted and awaited per step.

    group: process group the ops run in (``None``: the world).
    send_to, recv_from: *global* ranks of the next and previous rank in the ring; both equal to
        this rank for a ring of one, where ``send_recv`` returns a copy and no ``torch.distributed``
        call is made (and no event is emitted).
    timeout_s: bound on each ``wait()`` in seconds (``None``: :data:`~ds_ring.comm.wait.DEFAULT_TIMEOUT_S`).
    op: name used in events and errors, e.g. ``"ring_kv"``.

    Every transfer emits a ``send`` and a ``recv`` :class:`~ds_ring.hooks.Event` when hooks are
    registered; ``recv`` events carry ``extra["live_remote_blocks"]``: how many blocks received by
    this ring while a hook listened (including the one just received) are still referenced anywhere,
    ``extra["recv_allocated"]``: whether ``send_recv`` allocated the receive tensor (no ``recv_buffer`` given), and
    ``extra["recv_storage"]``: the address of the receive tensor's storage (a reused buffer keeps it). Each step also
    emits a ``ring_step`` start event in ``commit`` (before posting) and a ``ring_step`` end event
    in ``wait``: ``nbytes`` sent, ``seconds`` in flight (commit to completion),
    ``extra["received_bytes"]`` and ``extra["wait_s"]`` (the part of it spent blocked in ``wait``:
    what computing between ``commit`` and ``wait`` did not hide).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        send_to: int,
        recv_from: int,
        *,
        timeout_s: float | None = None,
        op: str = "ring",
    ) -> None:
        self.group = group
        self.rank = group_rank(None)
        self.send_to = send_to
        self.recv_from = recv_from
        self.op = op
        self.timeout_s = resolve_timeout(timeout_s)
        self._local = send_to == self.rank
        if self._local != (recv_from == self.rank):
            raise ValueError(
                f"ds_ring: rank {self.rank} cannot send to rank {send_to} and receive from rank "
                f"{recv_from}: a ring of one sends to and receives from itself only"
            )
        members = group_members(group)
        strangers = sorted({send_to, recv_from} - set(members))
        if strangers:
            raise ValueError(f"ds_ring: ring peers {strangers} are not in the process group {members}")
        self._queued: list[_Transfer] = []
        self._pending: list[Pending] | None = None
        self._in_stream = False  # CUDA data on NCCL: waits are stream-ordered (ds_ring.comm.wait)
        self._device = torch.device("cpu")
        self._posted: Any = None  # the CUDA event of a stream-ordered post, when hooks are listening
        self._step = -1
        self._posted_at = 0.0
        self._commits = 0
        self._live = _LiveBlocks()

    def send_recv(
        self,
        to_send: torch.Tensor,
        recv_buffer: torch.Tensor | None = None,
        *,
        recv_shape: tuple[int, ...] | torch.Size | None = None,
        recv_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Queue sending ``to_send`` to ``send_to`` and receiving a tensor from ``recv_from``.

        ``to_send`` is made contiguous (a copy when it is not) and must not be modified before
        ``wait()``. The receive goes into ``recv_buffer`` (contiguous) when given, else into a new
        tensor of ``recv_shape`` (default: ``to_send``'s shape) and ``recv_dtype`` (default: its
        dtype) on ``to_send``'s device. Returns the receive tensor; it is valid after ``wait()``.
        """
        if self._pending is not None:
            raise RuntimeError(
                f"ds_ring: RingComm({self.op}).send_recv() called between commit() and wait(); "
                "wait() for the posted step first"
            )
        to_send = to_send.contiguous()
        if recv_buffer is None:
            recv = torch.empty(
                to_send.shape if recv_shape is None else recv_shape,
                dtype=to_send.dtype if recv_dtype is None else recv_dtype,
                device=to_send.device,
            )
        elif recv_shape is not None or recv_dtype is not None:
            raise ValueError("ds_ring: pass either recv_buffer or recv_shape / recv_dtype, not both")
        elif not recv_buffer.is_contiguous():
            raise ValueError("ds_ring: recv_buffer must be contiguous")
        else:
            recv = recv_buffer
        if self._local:
            if recv.shape != to_send.shape or recv.dtype != to_send.dtype:
                raise ValueError(
                    f"ds_ring: a ring of one receives what it sends: expected {tuple(to_send.shape)} "
                    f"{to_send.dtype}, got a receive of {tuple(recv.shape)} {recv.dtype}"
                )
            recv.copy_(to_send)
        elif hooks_active():  # observation only: nothing per block while no hook listens
            self._live.add(self._commits, recv)
        self._queued.append(_Transfer(to_send, recv, recv_buffer is None))
        return recv

    def commit(self, step: int) -> None:
        """Post every queued transfer with one ``batch_isend_irecv``; ``step`` labels events and errors."""
        if self._pending is not None:
            raise RuntimeError(
                f"ds_ring: RingComm({self.op}).commit() called twice without wait() "
                f"(step {self._step} is still in flight)"
            )
        if not self._queued:
            raise RuntimeError(f"ds_ring: RingComm({self.op}).commit() with nothing queued; call send_recv() first")
        self._step = step
        self._commits += 1
        if self._local:
            self._posted_at = time.perf_counter()
            self._pending = []
            return
        if hooks_active("start"):
            sent = sum(t.send.numel() * t.send.element_size() for t in self._queued)
            emit(Event(kind="ring_step", rank=self.rank, op=self.op, step=step, peer=self.send_to, nbytes=sent,
                       phase="start", extra={"recv_from": self.recv_from}))  # fmt: skip
        self._posted_at = time.perf_counter()
        ops, pending = [], []  # empty tensors are not sent: both ends know every size from the plan
        for transfer in self._queued:
            if transfer.send.numel():
                ops.append(dist.P2POp(dist.isend, transfer.send, self.send_to, self.group))
                pending.append((self.send_to, f"send to rank {self.send_to}"))
            if transfer.recv.numel():
                ops.append(dist.P2POp(dist.irecv, transfer.recv, self.recv_from, self.group))
                pending.append((self.recv_from, f"recv from rank {self.recv_from}"))
        if not ops:
            self._pending = []
            return
        self._in_stream = stream_ordered(self.group, ops[0].tensor.device)
        self._device = ops[0].tensor.device
        self._posted = mark(self._device) if self._in_stream and hooks_active() else None
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as exc:  # e.g. the pair was closed by an earlier timeout or a dead peer
            self._queued = []
            what = f"posting {self._both_ways()}"
            raise failed(CommError(self.rank, self._either_peer(), step, self.op, what, str(exc))) from exc
        self._pending = self._describe(pending, works)

    def wait(self) -> None:
        """Wait (bounded by ``timeout_s``) until everything posted by ``commit`` has completed.

        Raises :class:`~ds_ring.comm.errors.CommTimeoutError` naming this rank, the peer, the
        committed step and ``op`` when the deadline passes.
        """
        if self._pending is None:
            raise RuntimeError(f"ds_ring: RingComm({self.op}).wait() before commit()")
        pending, transfers = self._pending, self._queued
        self._pending, self._queued = None, []
        posted, self._posted = self._posted, None
        waiting = mark(self._device) if posted is not None and pending else None
        blocked = wait_all(pending, timeout_s=self.timeout_s, rank=self.rank, op=self.op, step=self._step,
                           in_stream=self._in_stream)  # fmt: skip
        # Stream-ordered (NCCL): the host did not block; GPU times from events, read at the monitor's take.
        timing = StreamTiming(posted, waiting, mark(self._device)) if waiting is not None else None
        if hooks_active() and not self._local:
            self._emit(transfers, time.perf_counter() - self._posted_at, blocked, timing)

    def _describe(self, ops: list[tuple[int, str]], works: list[dist.Work]) -> list[Pending]:
        """``(peer, what)`` of each posted op, matched to its work; receives first (a missing block is the
        likelier question than an unacknowledged send)."""
        if len(works) != len(ops):  # the backend coalesced the batch into fewer works (NCCL)
            return [Pending(work, self._either_peer(), self._both_ways()) for work in works]
        described = [Pending(work, peer, what) for work, (peer, what) in zip(works, ops, strict=True)]
        return sorted(described, key=lambda p: not p.what.startswith("recv"))

    def _both_ways(self) -> str:
        return f"send to rank {self.send_to} / recv from rank {self.recv_from}"

    def _either_peer(self) -> int:
        """The peer to name when the backend does not say which op of a batch failed (-1: either)."""
        return self.send_to if self.send_to == self.recv_from else -1

    def _emit(
        self, transfers: list[_Transfer], seconds: float, blocked: float, timing: StreamTiming | None = None
    ) -> None:
        live = self._live.count()
        event = partial(Event, rank=self.rank, op=self.op, step=self._step, seconds=seconds)
        sent_total = received_total = 0
        for transfer in transfers:
            sent = transfer.send.numel() * transfer.send.element_size()
            received = transfer.recv.numel() * transfer.recv.element_size()
            if sent:
                emit(event(kind="send", peer=self.send_to, nbytes=sent))
            if received:
                storage = transfer.recv.untyped_storage().data_ptr()
                extra = {"live_remote_blocks": live, "recv_allocated": transfer.allocated, "recv_storage": storage}
                emit(event(kind="recv", peer=self.recv_from, nbytes=received, extra=extra))
            sent_total, received_total = sent_total + sent, received_total + received
        extra = {"recv_from": self.recv_from, "received_bytes": received_total, "wait_s": blocked}
        if timing is not None:
            extra["stream_timing"] = timing
        emit(event(kind="ring_step", peer=self.send_to, nbytes=sent_total, extra=extra))
