"""transformers' state-space, delta-rule and convolution layers, sequence-parallel and exact (:mod:`ds_ring.recurrent`).

These layers mix the sequence through a few module-level functions of their modeling file: ``causal_conv1d_fn``
(a causal depthwise convolution), ``mamba2_chunk_scan`` (Mamba2's scan), ``mamba_selective_scan`` (Mamba1's) and
``torch_chunk_gated_delta_rule`` / ``chunk_kimi_delta_attention`` (the gated delta rule's, Kimi's with a decay per
key channel).
While a model is registered, each such function of the families in :data:`FAMILIES` is replaced by one that, inside
the registered model's forward, runs the rank's shard exactly as the whole sequence would (the state and the
convolution's inputs carried across shards and reset at every packed document's first token), calling the original
for every piece; outside it, the original runs as it was. The fused kernels that skip those functions
(``mamba2_split_conv1d_scan_combined``, ``mamba_inner_fn``) answer "not available" while inside it, so the layer
takes its unfused path. The layer's own code runs unchanged around them. Two mixers are wrapped whole instead:
MiniMax's lightning attention and xLSTM's mLSTM backend, each run from the state carried into its chunks.

Under every strategy (ring, all-gather, Ulysses, hybrid) these layers run over the shards of the whole
sequence-parallel group, in the layout's chunk order: a layer's exchange is then a few states per rank, whatever the
sequence length, where re-sharding by heads (as Ulysses does attention) would move the whole activation twice.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ds_ring.integrations.hf.documents import DOCUMENTS_KEY
from ds_ring.integrations.hf.watch import ForwardWatch
from ds_ring.integrations.internal import (
    Patch,
    ShardPieces,
    Topology,
    causal_conv,
    delta_rule_scan,
    group_rank,
    group_size,
    process,
    selective_scan,
    set_attribute,
    shard_pieces,
    ssd_scan,
    undo_all,
)

__all__ = ["FAMILIES", "supported_mixer", "sequence_parallel_mixers", "install_recurrent"]

_CONV = ("causal_conv1d_fn",)
_SSD = ("causal_conv1d_fn", "mamba2_chunk_scan", "mamba2_split_conv1d_scan_combined")
_SELECTIVE = ("causal_conv1d_fn", "mamba_selective_scan", "mamba_inner_fn")
_DELTA = ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")


@dataclass(frozen=True)
class Family:
    """A modeling file whose mixer classes ``mixers`` mix the sequence only through its functions ``functions`` (none:
    the mixer's own forward is wrapped, :func:`_lightning`, :func:`_mlstm`)."""

    module: str
    mixers: tuple[str, ...]
    functions: tuple[str, ...]


FAMILIES: tuple[Family, ...] = (
    Family("lfm2", ("Lfm2ShortConv",), _CONV),
    Family("lfm3", ("Lfm3ShortConv",), _CONV),
    Family("mamba2", ("Mamba2Mixer",), _SSD),
    Family("bamba", ("BambaMixer",), _SSD),
    Family("falcon_h1", ("FalconH1Mixer",), _SSD),
    Family("granitemoehybrid", ("GraniteMoeHybridMambaLayer",), _SSD),
    Family("nemotron_h", ("NemotronHMamba2Mixer",), _SSD),
    Family("zamba2", ("Zamba2MambaMixer",), _SSD),
    Family("mamba", ("MambaMixer",), _SELECTIVE),
    Family("falcon_mamba", ("FalconMambaMixer",), _SELECTIVE),
    Family("jamba", ("JambaMambaMixer",), _SELECTIVE),
    Family("minimax", ("MiniMaxLightningAttention",), ()),
    Family("qwen3_next", ("Qwen3NextGatedDeltaNet",), _DELTA),
    Family("qwen3_5", ("Qwen3_5GatedDeltaNet",), _DELTA),
    Family("qwen3_5_moe", ("Qwen3_5MoeGatedDeltaNet",), _DELTA),
    Family("olmo_hybrid", ("OlmoHybridGatedDeltaNet",), _DELTA),
    Family("lara_mini", ("LaraMiniGatedDeltaNet",), _DELTA),
    Family("kimi_linear", ("KimiLinearDeltaAttention",), ("causal_conv1d_fn", "chunk_kimi_delta_attention")),
    Family("xlstm", ("xLSTMBackend",), ()),
)
"""Families whose sequence mixers ds_ring runs sequence-parallel (``transformers.models.<module>``)."""


def _modeling(family: Family) -> Any:
    return importlib.import_module(f"transformers.models.{family.module}.modeling_{family.module}")


def _family_of(module: nn.Module) -> Family | None:
    cls = type(module)
    for family in FAMILIES:
        if cls.__module__ == f"transformers.models.{family.module}.modeling_{family.module}" and (
            cls.__name__ in family.mixers
        ):
            return family
    return None


RECURRENT_SINCE = "5.24"
"""The transformers release whose layer code the replaced scan and convolution functions follow (tested there): on
older releases these layers are refused as sequence mixers, as before (their code differs: on 5.0 Jamba's mixer
asks for CUDA kernels on a CPU, MiniMax's lightning attention takes another path)."""


@torch.compiler.assume_constant_result  # torch 2.6's compiler cannot trace the import: run, not traced
def recurrent_supported() -> bool:
    """Whether this transformers release is one the sequence-parallel recurrent layers are written for (read once
    per process; not ``functools.cache``, whose wrapper the compiler warns about and traces through)."""
    owner = process()
    return owner.owned(owner, "recurrent layers supported", _recurrent_supported)


def _recurrent_supported() -> bool:
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__).release[:2] >= Version(RECURRENT_SINCE).release[:2]


def supported_mixer(module: nn.Module) -> bool:
    """Whether ``module`` is a sequence mixer ds_ring runs sequence-parallel (given the model instance)."""
    return recurrent_supported() and _family_of(module) is not None


def sequence_parallel_mixers(model: Any) -> tuple[nn.Module, ...]:
    """The modules of ``model`` (an instance; anything else has none) that ds_ring runs sequence-parallel."""
    if not isinstance(model, nn.Module):
        return ()
    return tuple(m for m in model.modules() if supported_mixer(m))


class _Shards(ForwardWatch):
    """What the replaced functions need while the registered model runs: the group, and the batch's documents."""

    def __init__(self, model: nn.Module, topology: Topology, layout: str, disable_in_eval: bool) -> None:
        self.group, self.timeout_s = topology.sequence_parallel_group, topology.timeout_s
        self.layout, self.disable_in_eval, self.model = layout, disable_in_eval, model
        self.active = False
        self.documents: tuple[int, ...] | None = None
        self.positions: torch.Tensor | None = None
        super().__init__(model)

    def _enter(self, _module: nn.Module, _args: tuple, kwargs: Mapping[str, Any]) -> None:
        self.active = self.model.training or not self.disable_in_eval
        documents = kwargs.get(DOCUMENTS_KEY)
        self.documents = tuple(documents.bounds) if documents is not None else None
        self.positions = kwargs.get("position_ids")

    def _leave(self, *_: Any) -> None:
        if self.model.training and torch.is_grad_enabled():
            return  # kept for the backward: activation checkpointing runs the layers again, outside this forward
        self.active, self.documents, self.positions = False, None, None

    def pieces(self, shard_len: int) -> ShardPieces:
        """This rank's chunks for a shard of ``shard_len`` tokens (documents from the batch: its
        ``ds_ring_cu_seqlens``, else its ``position_ids``, else one document)."""
        rank, world = group_rank(self.group), group_size(self.group)
        documents = self.documents
        if documents is None and self.positions is not None:
            documents = _documents_from_positions(self.positions, rank, world, self.layout)
        return shard_pieces(rank, world, self.layout, shard_len, documents)


def _documents_from_positions(positions: torch.Tensor, rank: int, world: int, layout: str) -> tuple[int, ...]:
    """The document starts a shard's global ``position_ids`` reveal (those inside its chunks and the ones its chunks'
    first tokens belong to), as boundaries ``(0, ..., S)``: all :func:`shard_pieces` reads."""
    row = positions.reshape(-1, positions.shape[-1])[0].tolist()
    empty = shard_pieces(rank, world, layout, len(row))
    total = empty.chunk_count * (len(row) // len(empty.chunks))
    starts = {0}
    for chunk in empty.chunks:
        for i in range(chunk.end - chunk.begin):
            if row[chunk.offset + i] == 0 or i == 0:
                starts.add(chunk.begin + i - row[chunk.offset + i])
    return (*sorted(starts), total)


def _refuse_state(what: str) -> ValueError:
    return ValueError(
        f"{what} under sequence parallelism: a cache (generation) cannot run on one rank's shard; generate "
        f"without ds_ring registered, or with the model in eval mode and disable_in_eval=True"
    )


def _replacements(shards: _Shards, originals: Mapping[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    """The functions that stand in for a modeling file's ``originals`` while registered."""
    from transformers.activations import ACT2FN

    def conv(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             activation: str | None = None, **kwargs: Any) -> torch.Tensor:  # fmt: skip
        if not shards.active:
            return originals["causal_conv1d_fn"](hidden_states, weight, bias, activation=activation, **kwargs)
        pieces = shards.pieces(hidden_states.shape[-1])
        out = causal_conv(hidden_states, weight, bias, pieces, shards.group, timeout_s=shards.timeout_s)
        if activation is not None:
            out = ACT2FN[activation](out)
        return out.to(hidden_states.dtype)

    def chunk_scan(*args: Any, initial_states: Any = None, return_final_states: bool = False, **kwargs: Any) -> Any:
        run = originals["mamba2_chunk_scan"]
        if not shards.active:
            return run(*args, initial_states=initial_states, return_final_states=return_final_states, **kwargs)
        if initial_states is not None or return_final_states:
            raise _refuse_state("a Mamba2 layer given an initial state or asked for its final state")
        kwargs.pop("seq_idx", None), kwargs.pop("cu_seqlens", None)  # documents come from the batch
        pieces = shards.pieces(args[0].shape[1])
        return ssd_scan(run, pieces, shards.group, *args, timeout_s=shards.timeout_s, **kwargs)

    def delta_rule(
        *args: Any, initial_state: Any = None, output_final_state: bool = False, **kwargs: Any
    ) -> tuple[torch.Tensor, Any]:
        run = originals[name_delta]
        if not shards.active:
            return run(*args, initial_state=initial_state, output_final_state=output_final_state, **kwargs)
        if initial_state is not None or output_final_state:
            raise _refuse_state("a gated delta rule layer given an initial state or asked for its final state")
        kwargs.pop("cu_seqlens", None)  # documents come from the batch
        pieces = shards.pieces(args[0].shape[1])
        return delta_rule_scan(run, pieces, shards.group, *args, timeout_s=shards.timeout_s, **kwargs), None

    def fused(*args: Any, **kwargs: Any) -> Any:
        return None if shards.active else originals[name_fused](*args, **kwargs)

    def selective(*args: Any, return_last_state: bool = False, **kwargs: Any) -> Any:
        run = originals["mamba_selective_scan"]
        if not shards.active:
            return run(*args, return_last_state=return_last_state, **kwargs)
        if return_last_state:
            raise _refuse_state("a Mamba layer asked for its last state")
        pieces = shards.pieces(args[0].shape[-1])
        return selective_scan(run, pieces, shards.group, *args, timeout_s=shards.timeout_s, **kwargs)

    name_fused = next((n for n in originals if n in ("mamba2_split_conv1d_scan_combined", "mamba_inner_fn")), "")
    name_delta = next((n for n in originals if n in ("torch_chunk_gated_delta_rule", "chunk_kimi_delta_attention")), "")
    table = {"causal_conv1d_fn": conv, "mamba2_chunk_scan": chunk_scan, "mamba_selective_scan": selective,
             "mamba2_split_conv1d_scan_combined": fused, "mamba_inner_fn": fused,
             "torch_chunk_gated_delta_rule": delta_rule, "chunk_kimi_delta_attention": delta_rule}  # fmt: skip
    return {name: table[name] for name in originals}


def install_recurrent(
    model: Any, topology: Topology, layout: str, *, disable_in_eval: bool = False
) -> Callable[[], None]:
    """Run ``model``'s supported sequence mixers sequence-parallel while registered; returns what undoes it.

    Args:
        model: the registered model instance (anything else: nothing to do).
        topology: the registered topology (its sequence-parallel group runs the mixers).
        layout: the section's layout (``contiguous`` / ``zigzag``): which chunks each rank holds.
        disable_in_eval: in eval mode the model runs whole sequences: the originals run.
    """
    mixers = sequence_parallel_mixers(model)
    if not mixers:
        return lambda: None
    shards = _Shards(model, topology, layout, disable_in_eval)
    undo: list[Patch] = []
    for family in dict.fromkeys(f for m in mixers if (f := _family_of(m)) is not None):
        modeling = _modeling(family)
        originals = {name: getattr(modeling, name) for name in family.functions if hasattr(modeling, name)}
        for name, replacement in _replacements(shards, originals).items():
            undo.append(set_attribute(modeling, name, replacement, library="transformers"))

    for mixer in (m for m in mixers if not _family_of(m).functions):
        wrapper = _mlstm if _family_of(mixer).module == "xlstm" else _lightning
        undo.append(set_attribute(mixer, "forward", wrapper(mixer, mixer.forward, shards), library="transformers"))

    def restore() -> None:
        undo_all(undo)  # the modeling functions, and the class's forward of every wrapped mixer again
        shards.remove()

    return restore


class _CarriedState:
    """What MiniMax's lightning attention asks its cache for: the state entering the shard (it then runs its own
    token-by-token recurrence from it); what it stores is dropped."""

    def __init__(self, state: torch.Tensor) -> None:
        self.state = state

    def get_linear_cache(self, _layer_idx: int) -> torch.Tensor:
        return self.state

    def set_linear_cache(self, _layer_idx: int, _state: torch.Tensor) -> None:
        pass


def _lightning(module: nn.Module, forward: Callable[..., Any], shards: _Shards) -> Callable[..., Any]:
    """MiniMax's lightning attention (``h_t = e^{-s} h_{t-1} + k_tᵀ v_t``, ``y_t = q_t h_t`` per head, then a norm
    and a gate) over this rank's shard: each segment runs from a zero state for its end state; the carried states
    (:func:`~ds_ring.recurrent.scan.carry_states`, decay ``e^{-s·len}``) then enter the segments that continue a
    document, which run again from them through the layer's own cached path (the norm after the recurrence makes
    the carried state's part not additive)."""

    def sequence_parallel(hidden_states: torch.Tensor, *args: Any, cache: Any = None, **kwargs: Any) -> Any:
        if not shards.active:
            return forward(hidden_states, *args, cache=cache, **kwargs)
        if cache is not None:
            raise _refuse_state("MiniMax's lightning attention given a cache")
        from ds_ring.integrations.internal import carry_states, tie

        batch = hidden_states.shape[0]
        pieces = shards.pieces(hidden_states.shape[1])
        runs = [
            [forward(hidden_states[:, s.start : s.stop], *args, **kwargs) for s in c.segments] for c in pieces.chunks
        ]
        size = pieces.chunks[0].end - pieces.chunks[0].begin
        decay = torch.exp(-module.slope_rate * size).expand(batch, -1, 1, 1)  # [b, heads, 1, 1]
        decays = [decay if c.passes_state else torch.zeros_like(decay) for c in pieces.chunks]
        finals = [outs[-1][1] for outs in runs]
        entering = carry_states(
            pieces, decays, finals, shards.group, op="recurrent_lightning", timeout_s=shards.timeout_s
        )
        outputs = []
        for chunk, outs, h_in in zip(pieces.chunks, runs, entering, strict=True):
            for segment, (out, _) in zip(chunk.segments, outs, strict=True):
                if segment is chunk.segments[0]:
                    if segment.continues:
                        carried = _CarriedState(h_in.to(finals[0].dtype))
                        out, _ = forward(hidden_states[:, segment.start : segment.stop], *args, cache=carried, **kwargs)
                    else:
                        out = tie(out, h_in)
                outputs.append(out)
        return torch.cat(outputs, dim=1), None

    return sequence_parallel


def _mlstm(module: nn.Module, forward: Callable[..., Any], shards: _Shards) -> Callable[..., Any]:
    """xLSTM's mLSTM backend over this rank's shard, its state carried exactly (no packed documents).

    Per head the mLSTM keeps a matrix memory ``C``, a normaliser ``n`` and a stabiliser ``m`` (``C`` and ``n`` are
    stored as ``e^{-m}`` times their true values). Over a run of tokens with total log forget gate ``G`` it maps
    ``(C, n, m)`` to ``m' = max(G + m, M)``, ``C' = e^{G + m - m'} C + e^{M - m'} C⁰`` (``n`` alike), where
    ``(C⁰, n⁰, M)`` is what the run reaches from ``(0, 0, -∞)``: the same max-plus and affine steps the layer's
    chunkwise kernel takes, regrouped. Each chunk runs once from ``(0, 0, -∞)`` for that summary; the summaries are
    all-gathered and folded in sequence order from the whole model's start ``(0, 0, 0)``; each chunk then runs again
    from the state so reached, through the layer's own initial-state path. A chunk must be a whole number of the
    layer's kernel chunks (``config.chunk_size``), so that it computes exactly as the whole sequence does."""

    def sequence_parallel(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, igate: torch.Tensor, fgate: torch.Tensor,
        c_initial: torch.Tensor | None = None, n_initial: torch.Tensor | None = None,
        m_initial: torch.Tensor | None = None, return_last_states: bool | None = None, mode: str | None = None,
    ) -> Any:  # fmt: skip
        given = (c_initial, n_initial, m_initial)
        if not shards.active:
            return forward(query, key, value, igate, fgate, *given, return_last_states=return_last_states, mode=mode)
        if any(state is not None and bool(state.ne(0).any()) for state in given):  # a cache's zeros: a fresh start
            raise _refuse_state("xLSTM's mLSTM layer given a state")
        from ds_ring.integrations.internal import gather_summaries, tie

        pieces = shards.pieces(query.shape[2])
        size, kernel = pieces.chunks[0].end - pieces.chunks[0].begin, module.config.chunk_size
        if size % kernel:
            raise ValueError(
                f"xLSTM's mLSTM layer computes in chunks of config.chunk_size = {kernel} tokens, and each of the "
                f"{pieces.chunk_count} chunks the ranks hold has {size}: ds_ring reproduces the whole model exactly "
                f"only on whole kernel chunks; use a sequence length that is a multiple of "
                f"{kernel * pieces.chunk_count}"
            )
        if any(len(c.segments) > 1 or (c.index > 0 and not c.segments[0].continues) for c in pieces.chunks):
            raise ValueError(
                "xLSTM's mLSTM layer under sequence parallelism with packed documents: ds_ring does not restart "
                "its state at a document's first token; train it on unpacked batches"
            )
        batch, heads, _, dqk = query.shape
        dtype = torch.promote_types(query.dtype, torch.float32)
        zeros_c = query.new_zeros(batch, heads, dqk, value.shape[-1], dtype=dtype)
        zeros_n, zeros_m = (
            query.new_zeros(batch, heads, dqk, dtype=dtype),
            query.new_zeros(batch, heads, 1, dtype=dtype),
        )
        parts = [
            tuple(t[:, :, c.offset : c.offset + size] for t in (query, key, value, igate, fgate)) for c in pieces.chunks
        ]
        summaries = []
        for part in parts:
            _, (c0, n0, m0) = forward(*part, zeros_c, zeros_n, zeros_m - torch.inf, mode="inference")
            g = torch.nn.functional.logsigmoid(part[4].to(dtype)).sum(-1, keepdim=True)  # [b, heads, 1]
            summaries.append(torch.cat([g.flatten(), m0.to(dtype).flatten(), c0.to(dtype).flatten(),
                                        n0.to(dtype).flatten()]))  # fmt: skip
        gathered = gather_summaries(
            torch.cat(summaries), shards.group, op="recurrent_mlstm", timeout_s=shards.timeout_s
        )
        cuts = [zeros_m.numel(), zeros_m.numel(), zeros_c.numel(), zeros_n.numel()]
        by_chunk = {}
        for rank, held in enumerate(pieces.order):
            for slot, index in enumerate(held):
                row = gathered[rank].view(len(held), -1)[slot]
                g, m, c, n = row.split(cuts)
                by_chunk[index] = (g.view_as(zeros_m), m.view_as(zeros_m), c.view_as(zeros_c), n.view_as(zeros_n))
        outputs, last = [], None
        for chunk, part in zip(pieces.chunks, parts, strict=True):
            c_in, n_in, m_in = zeros_c, zeros_n, zeros_m  # the whole model's start
            for index in range(chunk.index):
                g, m0, c0, n0 = by_chunk[index]
                m_out = torch.maximum(g + m_in, m0)
                carried, fresh = torch.exp(g + m_in - m_out), torch.exp(m0 - m_out)
                c_in = carried[..., None] * c_in + fresh[..., None] * c0
                n_in, m_in = carried * n_in + fresh * n0, m_out
            h, last = forward(*part, c_in, n_in, m_in, mode="inference")
            outputs.append(tie(h, gathered))
        h = torch.cat(outputs, dim=2)
        mode = mode or module.config.mode
        keep = return_last_states if return_last_states is not None else module.config.return_last_states
        return h if "train" in mode and not keep else (h, last)

    return sequence_parallel


def describe(mixers: Iterable[nn.Module]) -> str:
    """The mixer classes, for messages."""
    return ", ".join(sorted({type(m).__name__ for m in mixers}))
