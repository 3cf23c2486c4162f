"""All-gather, reduce-scatter and all-to-all with bounded waits.

``all_gather`` and ``reduce_scatter`` work on a *span*: a list of distinct global ranks (a
caller's sub-ring, e.g. the ranks a dilated segment covers), so no process group has to be
created at call time; ranks outside the span do not take part. When the span is the whole group
(in group-rank order), every member's size is equal and the backend runs that collective for
the dtype (:func:`ds_ring.comm.backends.runs_collective`: a table, so every rank decides alike),
the backend's collective is used; else, or with ``force_p2p=True``, one ``batch_isend_irecv`` of
the pairwise sends and receives. A collective that fails to post raises :class:`CommError`; it is
never silently replaced by the other path (another rank may already be in the collective).

No autograd: strategies define their own backward. Each call emits one
:class:`~ds_ring.hooks.Event` (``kind`` = the collective's name, ``nbytes`` = bytes received,
``seconds`` = from the call to completion, ``extra`` = ``span``, ``path`` (``"collective"`` or
``"p2p"``), ``sent_bytes``, ``wait_s`` (the part spent blocked waiting)) when hooks are
registered, and a ``phase="start"`` event of the same kind before posting for hooks that asked
for start events; a span of one moves nothing, makes no ``torch.distributed`` call and emits nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ds_ring.comm.backends import runs_collective
from ds_ring.comm.errors import CommError
from ds_ring.comm.gpu_timing import StreamTiming, mark
from ds_ring.comm.group_ranks import group_rank
from ds_ring.comm.spans import group_members, span_position
from ds_ring.comm.torch_compat import all_gather_single, reduce_scatter_single
from ds_ring.comm.wait import Pending, failed, resolve_timeout, stream_ordered, wait_all
from ds_ring.hooks import Event, emit, hooks_active

__all__ = ["all_gather", "all_reduce", "reduce_scatter", "all_to_all"]


def all_gather(
    tensor: torch.Tensor,
    span: Sequence[int],
    *,
    group: dist.ProcessGroup | None = None,
    numels: Sequence[int] | None = None,
    op: str = "all_gather",
    step: int = -1,
    force_p2p: bool = False,
    timeout_s: float | None = None,
) -> list[torch.Tensor]:
    """Gather every span member's 1-D ``tensor``; returns them in span order.

    numels: element count of each member's tensor (default: all equal to ``tensor.numel()``).
    The results are views of one new buffer of ``sum(numels)`` elements (own entry included).
    """
    call = _Call("all_gather", group, list(span), op, step, resolve_timeout(timeout_s))
    me = span_position(call.span, group)
    if tensor.dim() != 1:
        raise ValueError(f"ds_ring: all_gather takes a flat 1-D tensor, got shape {tuple(tensor.shape)}")
    numels = [tensor.numel()] * len(call.span) if numels is None else list(numels)
    if len(numels) != len(call.span) or numels[me] != tensor.numel():
        raise ValueError(
            f"ds_ring: all_gather numels {numels} must give one size per span member {call.span}, "
            f"with this rank's entry equal to its tensor's {tensor.numel()} elements"
        )
    tensor = tensor.contiguous()
    out = tensor.new_empty(sum(numels))
    parts = list(out.split(numels))
    if len(call.span) == 1:
        parts[0].copy_(tensor)
        return parts
    collective = None
    if not force_p2p and len(set(numels)) == 1 and call.span == group_members(group) and call.runs(tensor):
        gather = all_gather_single()
        collective = lambda: gather(out, tensor, group=group, async_op=True)

    def exchange() -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        parts[me].copy_(tensor)
        return [(peer, tensor, parts[j]) for j, peer in enumerate(call.span) if j != me]

    itemsize = tensor.element_size()
    sent, received = tensor.numel() * itemsize * (len(call.span) - 1), (sum(numels) - tensor.numel()) * itemsize
    _run(call, collective, exchange, sent_bytes=sent, received_bytes=received, device=tensor.device)
    return parts


def reduce_scatter(
    contributions: Sequence[torch.Tensor],
    span: Sequence[int],
    *,
    group: dist.ProcessGroup | None = None,
    op: str = "reduce_scatter",
    step: int = -1,
    force_p2p: bool = False,
    timeout_s: float | None = None,
) -> torch.Tensor:
    """Sum, over span members, of their contribution for this rank.

    contributions[i]: this rank's 1-D contribution for span member ``i``; every member must give
    member ``i`` the same number of elements (sizes may differ between members ``i``).
    Returns a new 1-D tensor of ``contributions[me].numel()`` elements in the contributions' dtype
    (the point-to-point path sums in span order).
    """
    call = _Call("reduce_scatter", group, list(span), op, step, resolve_timeout(timeout_s))
    me = span_position(call.span, group)
    contributions = [c.contiguous() for c in contributions]
    if len(contributions) != len(call.span):
        raise ValueError(
            f"ds_ring: reduce_scatter needs one contribution per span member {call.span}, got {len(contributions)}"
        )
    first = contributions[0]
    if any(c.dim() != 1 or c.dtype != first.dtype or c.device != first.device for c in contributions):
        raise ValueError("ds_ring: reduce_scatter contributions must be 1-D tensors of one dtype and device")
    mine = contributions[me]
    if len(call.span) == 1:
        return mine.clone()
    sizes = [c.numel() for c in contributions]
    out = mine.new_empty(mine.numel())
    collective = None
    if not force_p2p and len(set(sizes)) == 1 and call.span == group_members(group) and call.runs(mine):
        scatter = reduce_scatter_single()
        collective = lambda: scatter(out, torch.cat(contributions), group=group, async_op=True)
    received: list[torch.Tensor] = []  # the members' contributions for this rank, on the pairwise path

    def exchange() -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        received.extend(mine if j == me else mine.new_empty(mine.numel()) for j in range(len(call.span)))
        return [(peer, contributions[j], received[j]) for j, peer in enumerate(call.span) if j != me]

    itemsize = mine.element_size()
    sent, moved = (sum(sizes) - mine.numel()) * itemsize, mine.numel() * itemsize * (len(call.span) - 1)
    _run(call, collective, exchange, sent_bytes=sent, received_bytes=moved, device=mine.device)
    if collective is None:
        out.copy_(received[0])
        for term in received[1:]:
            out += term
    return out


def all_to_all(
    tensor: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    op: str = "all_to_all",
    step: int = -1,
    force_p2p: bool = False,
    timeout_s: float | None = None,
) -> torch.Tensor:
    """Equal-split all-to-all over ``group`` (``None``: the world) along dim 0.

    ``tensor``: ``[p * m, ...]`` for a group of ``p`` ranks. Chunk ``i`` (rows ``i*m:(i+1)*m``)
    goes to group rank ``i``; the result's chunk ``i`` is what group rank ``i`` sent here.
    Returns a new contiguous tensor of the same shape and dtype.
    """
    call = _Call("all_to_all", group, group_members(group), op, step, resolve_timeout(timeout_s))
    me = span_position(call.span, group)
    p = len(call.span)
    if tensor.dim() == 0 or tensor.shape[0] % p:
        raise ValueError(
            f"ds_ring: all_to_all needs dim 0 divisible by the group size {p}, got shape {tuple(tensor.shape)}"
        )
    tensor = tensor.contiguous()
    out = tensor.new_empty(tensor.shape)
    if p == 1:
        out.copy_(tensor)
        return out
    collective = None
    if not force_p2p and call.runs(tensor):
        collective = lambda: dist.all_to_all_single(out, tensor, group=group, async_op=True)

    def exchange() -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        rows = tensor.shape[0] // p
        sends = [tensor[i * rows : (i + 1) * rows] for i in range(p)]
        recvs = [out[i * rows : (i + 1) * rows] for i in range(p)]
        recvs[me].copy_(sends[me])
        return [(call.span[i], sends[i], recvs[i]) for i in range(p) if i != me]

    moved = tensor.numel() // p * (p - 1) * tensor.element_size()
    _run(call, collective, exchange, sent_bytes=moved, received_bytes=moved, device=tensor.device)
    return out


def all_reduce(
    tensor: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    op: str = "all_reduce",
    step: int = -1,
    timeout_s: float | None = None,
) -> torch.Tensor:
    """Sum ``tensor`` over every rank of ``group``; returns a new tensor (the input is left as it is)."""
    call = _Call("all_reduce", group, group_members(group), op, step, resolve_timeout(timeout_s))
    out = tensor.detach().clone()
    if len(call.span) == 1:
        return out
    call.begin()
    try:
        work = dist.all_reduce(out, group=group, async_op=True)
    except RuntimeError as exc:
        raise call.post_failed(f"all_reduce among ranks {call.span}", exc) from exc
    moved = out.numel() * out.element_size()
    _finish(call, [call.pending(work)], path="collective", sent_bytes=moved, received_bytes=moved, device=out.device)
    return out


@dataclass
class _Call:
    """One collective call: what error messages and events say about it."""

    kind: str  # "all_gather", "reduce_scatter", "all_to_all", "all_reduce"
    group: dist.ProcessGroup | None
    span: list[int]
    op: str
    step: int
    timeout_s: float
    rank: int = field(default_factory=lambda: group_rank(None))
    started: float = field(default_factory=time.perf_counter)

    def begin(self) -> None:
        """Emit the start event (for hooks that asked for start events) and restart the clock."""
        if hooks_active("start"):
            emit(Event(kind=self.kind, rank=self.rank, op=self.op, step=self.step, phase="start",
                       extra={"span": self.span}))  # fmt: skip
        self.started = time.perf_counter()

    def runs(self, tensor: torch.Tensor) -> bool:
        """Whether the backend runs this exchange as a collective for ``tensor``'s dtype and device type (alike
        on every rank: ranks of one group hold their data on one device type)."""
        return runs_collective(dist.get_backend(self.group), self.kind, tensor.dtype, tensor.device.type)

    def post(self, launch: Callable[[], dist.Work]) -> dist.Work:
        """``launch()``'s work; a backend error while posting becomes a :class:`CommError`."""
        try:
            return launch()
        except (RuntimeError, NotImplementedError) as exc:
            raise self.post_failed(f"{self.kind} among ranks {self.span}", exc) from exc

    def pending(self, work: dist.Work) -> Pending:
        return Pending(work, -1, f"{self.kind} among ranks {self.span}")

    def post_failed(self, what: str, exc: RuntimeError) -> CommError:
        return failed(CommError(self.rank, -1, self.step, self.op, f"posting {what}", str(exc)))


def _run(
    call: _Call,
    collective: Callable[[], dist.Work] | None,
    exchange: Callable[[], list[tuple[int, torch.Tensor, torch.Tensor]]],
    *,
    sent_bytes: int,
    received_bytes: int,
    device: torch.device,
) -> None:
    """Start ``call``, post the backend's ``collective`` (``None``: it does not run this call) or else the
    ``(peer, send, recv)`` pairs of ``exchange()`` as one batch, and finish it (:func:`_finish`)."""
    call.begin()
    if collective is None:
        pending, path = _post_exchange(call, exchange()), "p2p"
    else:
        pending, path = [call.pending(call.post(collective))], "collective"
    _finish(call, pending, path=path, sent_bytes=sent_bytes, received_bytes=received_bytes, device=device)


def _post_exchange(call: _Call, exchange: list[tuple[int, torch.Tensor, torch.Tensor]]) -> list[Pending]:
    """Post ``(peer, send, recv)`` pairs as one ``batch_isend_irecv``; receives are waited on first."""
    ops = []
    for peer, send, recv in exchange:
        ops.append(dist.P2POp(dist.isend, send, peer, call.group))
        ops.append(dist.P2POp(dist.irecv, recv, peer, call.group))
    peers = [peer for peer, _, _ in exchange]
    try:
        works = dist.batch_isend_irecv(ops)
    except RuntimeError as exc:  # e.g. a pair closed by an earlier timeout or a dead peer
        raise call.post_failed(f"{call.kind} exchange with ranks {peers}", exc) from exc
    if len(works) != len(ops):  # the backend coalesced the batch into fewer works (NCCL)
        return [Pending(work, -1, f"{call.kind} exchange with ranks {peers}") for work in works]
    recvs = [Pending(works[2 * i + 1], peer, f"recv from rank {peer}") for i, peer in enumerate(peers)]
    sends = [Pending(works[2 * i], peer, f"send to rank {peer}") for i, peer in enumerate(peers)]
    return recvs + sends


def _finish(
    call: _Call, pending: list[Pending], *, path: str, sent_bytes: int, received_bytes: int, device: torch.device
) -> None:
    """Bounded wait for ``pending`` (stream-ordered for ``device`` data on NCCL), then one event describing
    the call."""
    in_stream = stream_ordered(call.group, device)
    # Stream-ordered (NCCL): the host does not block, so GPU times come from events, read at the monitor's
    # take. A collective is waited on right after it is posted: posted and waiting are one event.
    waiting = mark(device) if in_stream and hooks_active() else None
    blocked = wait_all(pending, timeout_s=call.timeout_s, rank=call.rank, op=call.op, step=call.step,
                       in_stream=in_stream)  # fmt: skip
    if hooks_active():
        extra = {"span": call.span, "path": path, "sent_bytes": sent_bytes, "wait_s": blocked}
        if waiting is not None:
            extra["stream_timing"] = StreamTiming(waiting, waiting, mark(device))
        emit(
            Event(
                kind=call.kind,
                rank=call.rank,
                op=call.op,
                step=call.step,
                nbytes=received_bytes,
                seconds=time.perf_counter() - call.started,
                extra=extra,
            )
        )
