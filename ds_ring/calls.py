"""The entry layer: every attention call over sequence shards is prepared once per key, then run bare.

The first call with a given *key* — this rank's q/k/v shapes, dtypes and devices, whether a backward
follows, the strategy, and every option of the call (branches, causal, scale, layout, head offset,
documents, communication, timeout) — is

1. validated on this rank (shapes that cannot be described: ``ValueError`` before any communication);
2. agreed across the ranks of its placement (docs/design.md §Ranks agree: one small all-gather on a group that takes
   CPU tensors; ranks whose calls differ all raise one ``ValueError`` naming each field and each rank's
   value), so the strategy's checks below give the same answer on every rank;
3. checked by its strategy (:meth:`~ds_ring.strategies.Strategy.check`: the same rules the ds_config's
   section is checked with) and planned and bound (:meth:`~ds_ring.strategies.Strategy.prepare`).

Every later call with that key runs the bound function directly: no validation, no agreement lookup and
no read of a tensor's values on the host, as long as document boundaries come as Python ints
(``cu_seqlens=(0, 3000, 16384)``; a tensor is read back to key the call, a device sync on a GPU).
Prepared calls are kept per placement (a :class:`~ds_ring.Topology` or a process group) by the job's
:class:`~ds_ring.comm.job.Job`, the least recently used dropped after :data:`CACHE_SIZE`. Limit, as for every
such cache: a rank whose call changes while the others repeat one they prepared is the only one that exchanges;
it fails after its timeout with an error saying so.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

import ds_ring.auto  # noqa: F401  (registers strategy "auto")
from ds_ring.comm.agree import agree
from ds_ring.comm.group_ranks import group_rank, group_size, takes_cpu
from ds_ring.comm.job import job
from ds_ring.compiler.attention_op import compilable
from ds_ring.cpu_heap import configure_cpu_heap
from ds_ring.kernels.dilation import check_cu_seqlens, check_softcap, validate_qkv
from ds_ring.kernels.sinks import check_sinks
from ds_ring.kernels.spans import Spans, resolve_spans
from ds_ring.parallel.topology import Topology
from ds_ring.strategies import DEFAULT_STRATEGY, AttentionCall, Bound, Degrees, Placement, Shape, Target, get_strategy
from ds_ring.strategies.base import NOT_AGREED

__all__ = [
    "AttentionCall",
    "Output",
    "attend",
    "ring_dilated_attention",
    "sequence_parallel_attention",
    "topology_placement",
    "group_placement",
    "CACHE_SIZE",
]

Output = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""What an attention call returns: the output shard, or ``(out, lse)`` with ``return_lse``."""

CACHE_SIZE = 256
"""Prepared calls kept per placement."""

_lock = threading.Lock()


@compilable  # under torch.compile: one custom op (ds_ring/compiler/attention_op.py)
def ring_dilated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: Sequence[int] | None = None,
    dilation_rates: Sequence[int] | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    group: ProcessGroup | None = None,
    communication: str | None = None,
    layout: str = "contiguous",
    head_offset: int = 0,
    return_lse: bool = False,
    timeout_s: float | None = None,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    strategy: str = DEFAULT_STRATEGY,
    bidirectional_spans: torch.Tensor | Sequence | None = None,
    prefix_lengths: int | Sequence[int] | None = None,
) -> Output:
    """Dilated (or dense) attention over a sequence sharded across ``group``.

    Every rank passes its shard, made by :func:`ds_ring.shard_sequence` with the same ``layout``.

    Args:
        q: local shard ``[batch, seq/p, heads, head_dim]``; k: ``[batch, seq/p, kv_heads, head_dim]``; v:
            ``[batch, seq/p, kv_heads, v_head_dim]`` (``v_head_dim`` may differ: multi-head latent attention).
        segment_lengths, dilation_rates: LongNet branches over the *global* sequence; ``None`` = dense.
            Segments may cross shard boundaries anywhere; only the kept rows of those that do travel.
        causal: causal mask by global position.
        group: the sequence-parallel process group (``None``: the default group).
        communication: ``"ring"`` (K/V passed rank to rank, O(seq/p) memory) or ``"allgather"`` (``None``: the
            strategy's default, ``"ring"``).
        layout: ``"contiguous"`` or ``"zigzag"`` (dense only; balances causal work).
        head_offset: global index of local head 0 (dilation offsets use global head indices).
        return_lse: also return ``lse [batch, heads, seq/p]`` (float32; float64 for float64 inputs).
        timeout_s: bound on every communication wait (``None``: 300 s, :data:`ds_ring.comm.DEFAULT_TIMEOUT_S`).
        cu_seqlens: document boundaries ``[0, e1, ..., seq]`` over the *global* sequence (integers, the same on
            every rank; Python ints cost nothing per call): each document is attended as if alone; K/V of other
            documents are neither computed on nor sent. ``None``: one document.
        window: causal sliding window (dense, ``causal=True``): query ``i`` sees keys ``[i - window + 1, i]``; only
            the ranks and rows within its reach travel.
        sinks: ``[heads]`` attention-sink logits (GPT-OSS): one more key per head with that score and value 0,
            differentiable (its gradient is this rank's rows' share, like a parameter's).
        softcap: attention logit soft-capping (Gemma 2): scores ``s`` become ``softcap·tanh(s / softcap)`` before
            the softmax (sinks are not capped). ``None``: uncapped.
        strategy: ``"ring"``, ``"allgather"``, ``"ulysses"`` (all-to-all over ``group``), or ``"auto"``: the fastest
            of those the call admits by :mod:`ds_ring.auto` (chosen alike on every rank, logged).
        bidirectional_spans, prefix_lengths: bidirectional spans inside the causal sequence, as
            :func:`sequence_parallel_attention`.

    Returns:
        The local output shard ``[batch, seq/p, heads, v_head_dim]`` (and the LSE, the sinks included).

    Raises:
        ValueError: bad shapes (on this rank, before any communication); ranks whose calls differ
            (on every rank, after one small exchange on a key's first call); an unsupported layout /
            segment / shard combination — all before any data moves.
    """
    return attend(q, k, v, AttentionCall.of(locals()), group_placement(group), strategy, op="ring_dilated_attention")


@compilable
def sequence_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: Sequence[int] | None = None,
    dilation_rates: Sequence[int] | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    topology: Topology,
    strategy: str = DEFAULT_STRATEGY,
    communication: str | None = None,
    layout: str = "contiguous",
    head_offset: int = 0,
    return_lse: bool = False,
    timeout_s: float | None = None,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    bidirectional_spans: torch.Tensor | Sequence | None = None,
    prefix_lengths: int | Sequence[int] | None = None,
) -> Output:
    """Dilated (or dense) attention over a sequence sharded across ``topology.sequence_parallel_group``.

    Args:
        q: local shard ``[batch, seq/p, heads, head_dim]``; k: ``[batch, seq/p, kv_heads, head_dim]``; v:
            ``[batch, seq/p, kv_heads, v_head_dim]`` (``v_head_dim`` may differ from ``head_dim``: multi-head latent
            attention, DeepSeek V2/V3), made by ``ds_ring.shard_sequence(x, topology, layout=layout)``.
        segment_lengths, dilation_rates: LongNet branches over the global sequence; ``None``: dense.
        causal: causal mask by global position.
        scale: softmax scale, default ``1/sqrt(head_dim)``.
        topology: the process groups (:class:`ds_ring.Topology`).
        strategy: ``"ring"``, ``"allgather"``, ``"ulysses"``, ``"hybrid"``, ``"auto"`` (the fastest of those the
            topology and the call admit, by :mod:`ds_ring.auto`) or any registered one.
        communication: how a ring dimension moves K/V (``"ring"`` or ``"allgather"``) for ``ring`` and
            ``hybrid``; ``None``: the strategy's default (``allgather`` always all-gathers; ``ulysses`` has no
            ring dimension and refuses one).
        layout: ``"contiguous"`` or ``"zigzag"``; zigzag with dilation works for ``ulysses`` (and ``hybrid``
            with ring degree 1), the ring dimension of the others supports it for dense attention only.
        head_offset: global index of local head 0 (dilation offsets use global head indices).
        return_lse: also return ``lse [batch, heads, seq/p]`` (float32; float64 for float64 inputs).
        timeout_s: bound on every communication wait (``None``: ``topology.timeout_s``).
        cu_seqlens: document boundaries ``[0, e1, ..., seq]`` of a packed sequence over the *global*
            sequence (integers, the same on every rank and batch row; Python ints cost nothing per call):
            each document is attended as if alone, on every strategy and layout. ``None``: one document.
        window: causal sliding window (dense, ``causal=True``): query ``i`` sees keys ``[i - window + 1, i]`` of its
            document, on every strategy and layout; a ring moves only the blocks and rows within its reach.
        sinks: ``[heads]`` attention-sink logits of ``q``'s heads (GPT-OSS), differentiable.
        softcap: attention logit soft-capping (Gemma 2, ``attn_logit_softcapping``): scores ``s = q·k·scale``
            become ``softcap·tanh(s / softcap)`` before the softmax, on every strategy (the tiled pure-torch
            block kernel computes capped blocks; sinks are not capped). ``None``: uncapped.
        bidirectional_spans: tokens that see each other fully inside the causal sequence (Gemma 3's image tokens):
            ``(start, stop)`` pairs over the *global* sequence, or per-token span ids ``[seq]`` (0: causal token;
            equal nonzero ids: one span of consecutive tokens; a tensor is read to the host), the same on every rank
            and batch row; each span inside one document. Dense attention, ``causal=True``; with a ``window`` the mask
            is ``(causal OR same span) AND window`` (Gemma 3's sliding layers; spans at most the window). Every
            strategy and layout; a ring moves only the rows of a span that reach back into an earlier shard.
        prefix_lengths: prefix-LM (PaliGemma): the first ``P`` tokens of each document see each other fully; one
            int, or one per document (the span ``(c_j, c_j + P_j)``).

    Returns:
        The local output shard ``[batch, seq/p, heads, v_head_dim]`` in the input dtype (and the LSE, the sinks
        included).

    Raises:
        ValueError: bad shapes (on this rank, before any communication); ranks whose calls differ in
            anything (on every rank, naming the field and each rank's value, after one small exchange
            on a key's first call); an unknown strategy or communication, or anything the strategy
            cannot do (heads not divisible by the all-to-all degree, unsupported branches or layout)
            — all before any data moves.
    """
    return attend(q, k, v, AttentionCall.of(locals()), topology_placement(topology), strategy)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    call: AttentionCall,
    placement: Placement,
    strategy: str,
    *,
    op: str = "sequence_parallel_attention",
) -> Output:
    """Run ``call`` with ``strategy`` over ``placement`` (prepared on its key's first call); ``op`` names the
    entry point in agreement errors. Shapes and returns as :func:`sequence_parallel_attention`."""
    if call.bidirectional_spans is not None or call.prefix_lengths is not None:
        seq = q.shape[1] * placement.degrees.sequence if q.dim() == 4 else 0
        call = dataclasses.replace(call, bidirectional_spans=_spans(call, seq), prefix_lengths=None)
    backward = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    key = (op, strategy, q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, backward,
           call.key())  # fmt: skip
    prepared = placement.prepared
    with _lock:
        bound = prepared.get(key)
        if bound is not None:
            prepared.move_to_end(key)
    if bound is None:
        bound = _prepare(q, k, v, call, placement, strategy, op, backward)
        with _lock:
            prepared[key] = bound
            if len(prepared) > CACHE_SIZE:
                prepared.popitem(last=False)
    out, lse = bound(q, k, v, call.sinks)
    return (out, lse.transpose(1, 2)) if call.return_lse else out


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    call: AttentionCall,
    placement: Placement,
    strategy: str,
    op: str,
    backward: bool,
) -> Bound:
    """Validate, agree, check and plan one key's call; the bound function for it."""
    if q.device.type == "cpu":
        configure_cpu_heap()  # once per process: freed tensors leave the RSS (ds_ring/cpu_heap.py)
    validate_qkv(q, k, v, call.head_offset)
    check_sinks(call.sinks, q)
    call = dataclasses.replace(call.validated(), softcap=check_softcap(call.softcap))
    described = call.described()
    _agree_on_call(q, k, v, described, placement, strategy, op, backward, call.timeout_s)
    chosen = get_strategy(strategy)
    shape = Shape.of(q, k)
    documents = check_cu_seqlens(described["cu_seqlens"], shape.rows * placement.degrees.sequence)
    # The bound function gets the sinks per call; it keeps no tensor of this call (the documents as checked ints).
    call = _resolved(call, chosen.default_communication(), placement.timeout_s, documents)
    chosen.check(call, shape, placement.degrees)
    return chosen.prepare(call, Target(shape, placement, q.device, documents))


def _resolved(
    call: AttentionCall, communication: str | None, timeout_s: float | None, documents: tuple[int, ...] | None
) -> AttentionCall:
    """``call`` with the strategy's default communication and the placement's timeout where it names none, the
    checked documents and no sinks (a prepared call keeps no tensor)."""
    fields: dict[str, Any] = {"cu_seqlens": documents, "sinks": None}
    if call.communication is None and communication is not None:
        fields["communication"] = communication
    if call.timeout_s is None and timeout_s is not None:
        fields["timeout_s"] = timeout_s
    return dataclasses.replace(call, **fields)


def _agree_on_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    described: dict[str, Any],
    placement: Placement,
    strategy: str,
    op: str,
    backward: bool,
    timeout_s: float | None,
) -> None:
    """Collective over the placement's sequence-parallel group: ``ValueError`` on every rank unless all of
    them make this call alike (shapes, dtype, device type, backward, strategy and every agreed field of the call)."""
    batch, rows, heads, head_dim = q.shape
    fields = {
        "batch": batch, "rows": rows, "heads": heads, "kv_heads": k.shape[2], "head_dim": head_dim,
        "v_head_dim": v.shape[3], "dtype": q.dtype, "device": q.device.type, "backward": backward,
        "strategy": strategy, **{name: value for name, value in described.items() if name not in NOT_AGREED},
    }  # fmt: skip
    control = placement.control(placement.sequence)
    timeout_s = timeout_s if timeout_s is not None else placement.timeout_s
    group, device = (placement.sequence, q.device) if control is None else (control, None)
    agree(fields, group=group, op=op, timeout_s=timeout_s, cache=False, device=device)


def _spans(call: AttentionCall, seq: int) -> Spans | None:
    """The call's bidirectional spans, resolved and checked over the global sequence of ``seq`` tokens (a tensor of
    span ids read back: a host sync on a GPU)."""
    bounds = check_cu_seqlens(call.described()["cu_seqlens"], seq) or (0, seq)
    return resolve_spans(call.bidirectional_spans, call.prefix_lengths, bounds)


def topology_placement(topology: Topology) -> Placement:
    """The placement of calls over ``topology`` (built once per topology)."""

    def make() -> Placement:
        degrees = Degrees(topology.ulysses, topology.ring, topology.get_sequence_parallel_rank())
        return Placement(
            degrees, topology.sequence_parallel_group, topology.ulysses_group, topology.ring_group,
            topology.timeout_s, topology.control_group,
        )  # fmt: skip

    return job().owned(topology, "placement", make)


def group_placement(group: ProcessGroup | None) -> Placement:
    """The placement of calls over a plain process group (``None``: the world): one ring of all its ranks.

    Control traffic takes the group itself when its backend takes CPU tensors, else tensors of the data's
    device (there is no gloo twin to use: creating one is collective over the whole job). Without
    ``torch.distributed`` every rank is the whole sequence.
    """
    owner = job()
    if not dist.is_initialized():
        return owner.owned(owner, "placement", lambda: Placement(Degrees(), None, None, None, None, lambda _: None))

    def make() -> Placement:
        cpu = group if takes_cpu(group) else None
        return Placement(Degrees(1, group_size(group), group_rank(group)), group, None, group, None, lambda _: cpu)

    return owner.owned(dist.group.WORLD if group is None else group, "placement", make)
