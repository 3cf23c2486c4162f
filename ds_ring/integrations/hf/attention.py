"""The attention function ds_ring puts in transformers' registry, and the model features it refuses.

transformers' attention modules (``LlamaAttention``, ``Qwen2Attention``, ...) project, apply RoPE,
then call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, dropout=,
scaling=, **kwargs)`` with ``q [b, heads, s, d]``, ``k, v [b, kv_heads, s, d]`` and expect
``(out [b, s, heads, d], weights)`` back. Under sequence parallelism ``s`` is this rank's shard and
:class:`SequenceParallelAttention` answers with ``ds_ring.sequence_parallel_attention``. Nothing
here imports transformers.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ds_ring.calls import sequence_parallel_attention
from ds_ring.comm.agree import agree
from ds_ring.config import SECTION, RingAttentionConfig
from ds_ring.integrations.hf.audit import CallAudit, ModelWatch
from ds_ring.integrations.hf.compiled import Site, attention_handle, compiled_attention
from ds_ring.integrations.hf.documents import DOCUMENTS_KEY, Documents, document_positions
from ds_ring.integrations.hf.masks import MaskSpec, check_mask_tensor
from ds_ring.parallel.order import shard_sequence
from ds_ring.parallel.topology import Topology
from ds_ring.zero import parameter_gradient_scale

__all__ = ["SequenceParallelAttention", "Site"]

AttentionFunction = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
_CHECKED_KEPT = 1024  # checked call signatures remembered per attention function (least recently used dropped)


class SequenceParallelAttention:
    """A transformers attention function running ``ds_ring.sequence_parallel_attention`` on shards.

    Called by the model with this rank's shard: ``query [b, heads, s/p, d]``, ``key, value
    [b, kv_heads, s/p, d]`` (K/V heads are passed on as they are, not repeated), the kwargs the model
    forwards — ``position_ids [b or 1, s/p]`` (global positions, from ``shard_batch``) and the document
    boundaries ``[0, ..., S]`` over the whole sequence (``ds_ring_cu_seqlens``, Python ints, or
    ``cu_seq_lens_q``, a tensor read back per call, or the documents :meth:`expect_documents` was given for
    that ``position_ids`` tensor) are required — and returns
    ``(out [b, s/p, heads, d], None)``. Shapes, documents and positions are checked on the first call of
    each; later calls read nothing on the host. What the model's mask says is computed, never discarded: a
    :class:`~ds_ring.integrations.hf.masks.MaskSpec` (what ds_ring's mask interface returns) gives causal and the
    window, and one it cannot compute is refused; a mask tensor the model built itself is checked on the first
    call against causal, the window and the documents, and refused if it says more. For attention modules that
    receive no ``**kwargs`` the batch's ``position_ids`` and documents come from the registered model's call
    (:class:`~ds_ring.integrations.hf.audit.ModelWatch`), which also learns which modules called this.

    Every refusal is a ``ValueError`` raised before any communication.
    """

    def __init__(
        self,
        section: RingAttentionConfig,
        topology: Topology,
        original: AttentionFunction | None,
        *,
        disable_in_eval: bool,
        zero_optimization: Mapping[str, Any] | None = None,
    ) -> None:
        self.section = section
        self.topology = topology
        self.original = original
        self.disable_in_eval = disable_in_eval
        self.zero_optimization = zero_optimization
        self.gradient_scale: int | None = None
        """What ds_ring's losses scale each rank's gradient share by for the engine of the model that calls
        this (:func:`ds_ring.zero.parameter_gradient_scale`), read off the first module's parameters at its first
        call; the session's :attr:`~ds_ring.integrations.hf.session.SequenceParallelSession.gradient_scale`."""
        self.session: Any = None
        """The :class:`~ds_ring.integrations.hf.session.SequenceParallelSession` this belongs to (what
        ``installed_sessions`` finds through transformers' registry)."""
        self.long_context_applied = not section.long_context.enabled
        """Whether the section's ``long_context`` was applied (``session.apply_long_context``); a call before is
        refused, so the section is never ignored without a word."""
        self.watch: ModelWatch | None = None
        """The registered model's hook (``None``: registered without a model instance)."""
        self.audit: CallAudit | None = None
        """Told of every call (attention modules that never call this are refused)."""
        self._checked: OrderedDict[tuple, None] = OrderedDict()  # (heads, kv_heads, positions' shape, documents,
        # mask, window) checked, the _CHECKED_KEPT most recent: packed batches bring new documents every step
        self._expected: dict[int, tuple[weakref.ref, Documents]] = {}  # id(position_ids) -> (it, its documents)
        self.handle = attention_handle(self)
        """How a compiled model's ``ds_ring::hf_attention`` finds this (:mod:`ds_ring.integrations.hf.compiled`)."""

    def expect_documents(self, position_ids: torch.Tensor, documents: Documents) -> None:
        """The documents of the whole sequence whose shard has ``position_ids [b or 1, s/p]``, for a model called
        with that tensor and no ``cu_seq_lens_q`` (what ``UlyssesSPDataLoaderAdapter`` yields: ALST's keys only).

        Kept while ``position_ids`` lives (a weak reference: an entry goes with its batch, so it can never be
        read for another tensor that reuses its ``id``). A call finds them by the tensor's identity, or, for a
        copy (another device, a checkpoint's detached input), by equal positions when every live entry with
        those positions has the same documents.
        """
        key = id(position_ids)
        self._expected[key] = (weakref.ref(position_ids, lambda _: self._expected.pop(key, None)), documents)

    def __call__(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if self.audit is not None:
            self.audit.attended(module)
        if self.disable_in_eval and not module.training:
            return self.original(
                module, query, key, value, attention_mask,
                dropout=dropout, scaling=scaling, sliding_window=sliding_window, softcap=softcap, **kwargs,
            )  # fmt: skip
        if not self.long_context_applied:
            raise ValueError(
                f"the ds_config's {SECTION}.long_context switches on tiling or offloading, which is applied to the "
                f"model instance, and it was not; call session.apply_long_context(model) with the session "
                f"register_with_transformers returned (or drop {SECTION}.long_context)"
            )
        if self.watch is not None:
            kwargs = {**self.watch.batch, **{k: v for k, v in kwargs.items() if v is not None}}
        spec = attention_mask if isinstance(attention_mask, MaskSpec) else None
        if spec is not None:  # the mask is the truth (eager and sdpa follow it, not the sliding_window argument)
            sliding_window = spec.window
        self._refuse_features(module, dropout, softcap, spec, kwargs)
        if self.gradient_scale is None:
            self._read_gradient_scale(module)
        site = Site(type(module).__name__, _config_name(module), spec, sliding_window)
        if torch.compiler.is_compiling():  # one custom op the compiler holds whole (integrations/hf/compiled.py)
            return compiled_attention(self, site, query, key, value, attention_mask, scaling, softcap, kwargs), None
        return self.attend(site, query, key, value, attention_mask, scaling, softcap, kwargs), None

    def attend(
        self,
        site: Site,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        scaling: float | None,
        softcap: float | None,
        kwargs: Mapping[str, Any],
    ) -> torch.Tensor:
        """The sequence-parallel attention of one call from ``site`` once its module's features were checked: the
        documents, positions and mask checked on the first call of each, then ``out [b, s/p, heads, d]``."""
        spec, sliding_window = site.spec, site.window
        bounds = self._document_bounds(kwargs)
        mask_key = spec if spec is not None else (None if attention_mask is None else tuple(attention_mask.shape))
        checked = (query.shape[1], key.shape[1], kwargs["position_ids"].shape, bounds, mask_key, sliding_window)
        if checked in self._checked:  # once per shape, documents and mask: no host read in steady state
            self._checked.move_to_end(checked)
        else:
            self._check_shapes(site, query, key, bounds[-1])
            self._agree_on_documents(bounds)
            self._check_positions(kwargs["position_ids"], bounds)
            if isinstance(attention_mask, torch.Tensor):
                self._check_mask(site, attention_mask, bounds, sliding_window)
            self._checked[checked] = None
            if len(self._checked) > _CHECKED_KEPT:
                self._checked.popitem(last=False)
        window = None if sliding_window is None or sliding_window >= bounds[-1] else sliding_window
        branches = (None, None) if window is not None else (self.section.segment_lengths, self.section.dilation_rates)
        return sequence_parallel_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), *branches,
            causal=self.section.causal, scale=scaling, topology=self.topology, strategy=self.section.strategy,
            communication=self.section.communication, layout=self.section.layout,
            cu_seqlens=bounds if len(bounds) > 2 else None, window=window, sinks=kwargs.get("s_aux"),
            softcap=softcap,
        )  # fmt: skip

    def _refuse_features(
        self, module: nn.Module, dropout: float, softcap: float | None, spec: MaskSpec | None, kwargs: dict
    ) -> None:
        if spec is not None and spec.unsupported is not None:
            raise ValueError(
                f"{type(module).__name__} is given a mask with {spec.unsupported}, which ds_ring's attention does "
                f"not compute (it computes causal or bidirectional attention, a causal sliding window and packed "
                f"documents); train this model without sequence parallelism"
            )
        if dropout:
            raise ValueError(
                f"{_config_name(module)}.attention_dropout = {dropout} in training: ds_ring's attention has no "
                f"dropout; set attention_dropout=0.0"
            )
        causal = spec.causal if spec is not None else kwargs.get("is_causal", getattr(module, "is_causal", True))
        if causal != self.section.causal:
            raise ValueError(
                f"{type(module).__name__} attends {'causally' if causal else 'bidirectionally'} but {SECTION}.causal "
                f"is {self.section.causal}; set causal to {str(bool(causal)).lower()}"
            )

    def _read_gradient_scale(self, module: nn.Module) -> None:
        """The scale the model's engine needs (from its parameters and the ds_config given at registration),
        before any gradient exists; the same for every layer of a model."""
        self.gradient_scale = parameter_gradient_scale(
            module.parameters(), self.zero_optimization, self.topology.get_sequence_parallel_world_size(),
            where=type(module).__name__,
        )  # fmt: skip

    def _document_bounds(self, kwargs: dict) -> tuple[int, ...]:
        """The documents of the whole sequence: ``ds_ring_cu_seqlens`` (Python ints, from :func:`shard_batch`),
        else ``cu_seq_lens_q`` read back from its tensor (a host sync per layer on a GPU)."""
        if kwargs.get("position_ids") is None:
            raise ValueError(
                "the model passed no position_ids to its attention: ds_ring needs every token's global position "
                "(each rank holds a slice of the sequence); call the model with position_ids from "
                "ds_ring.integrations.hf.shard_batch, and pass the model instance to register_with_transformers (it "
                "then hands them to attention modules that receive no keyword arguments)"
            )
        documents = kwargs.get(DOCUMENTS_KEY)
        if documents is not None:
            return documents.bounds
        cu = kwargs.get("cu_seq_lens_q")
        if cu is None:
            return self._expected_bounds(kwargs["position_ids"])
        other = kwargs.get("cu_seq_lens_k")
        if other is not None and not torch.equal(other, cu):
            raise ValueError("cu_seq_lens_k differs from cu_seq_lens_q; self-attention needs one set of documents")
        return tuple(cu.tolist())

    def _expected_bounds(self, position_ids: torch.Tensor) -> tuple[int, ...]:
        """The documents :meth:`expect_documents` was given for ``position_ids`` (or an equal copy of it)."""
        entry = self._expected.get(id(position_ids))
        if entry is not None and entry[0]() is position_ids:
            return entry[1].bounds
        found = {
            documents.bounds
            for ref, documents in list(self._expected.values())
            if (known := ref()) is not None
            and known.shape == position_ids.shape
            and torch.equal(known.to(position_ids.device), position_ids)
        }
        if len(found) == 1:
            return found.pop()
        if found:
            raise ValueError(
                f"the model's position_ids match {len(found)} live batches of UlyssesSPDataLoaderAdapter with "
                f"different documents ({sorted(found)}); call the model with the adapter's batch itself "
                f"(model(**batch)), or pass cu_seq_lens_q"
            )
        raise ValueError(
            "the model was called without cu_seq_lens_q and with position_ids of no batch UlyssesSPDataLoaderAdapter "
            "yielded, so the attention cannot tell a sharded sequence from a whole one; call it with the adapter's "
            "batch (model(**batch)), or with every entry of shard_batch(batch, topology) (shift_labels aside)"
        )

    def _check_shapes(self, site: Site, query: torch.Tensor, key: torch.Tensor, seq_len: int) -> None:
        heads, kv_heads = query.shape[1], key.shape[1]
        sp = self.topology.get_sequence_parallel_world_size()
        if query.shape[2] * sp != seq_len:
            raise ValueError(
                f"this rank holds {query.shape[2]} tokens, which is not 1/{sp} of the {seq_len} tokens that "
                f"cu_seq_lens_q ends at; pass the batch shard_batch made for this topology"
            )
        name = site.config
        try:
            self.section.check(
                world_size=self.topology.world_size, num_heads=heads, num_kv_heads=kv_heads, seq_len=seq_len
            )
        except ValueError as err:
            raise ValueError(f"{name}.num_attention_heads = {heads}, sequence length {seq_len}: {err}") from None

    def _agree_on_documents(self, bounds: tuple[int, ...]) -> None:
        """``ValueError`` on every rank of the group unless all pass the same documents: ranks that shard
        different samples by hand would attend across their samples as if they were one sequence (ALST stitches
        them without a word). One small exchange per new set of documents (then remembered)."""
        group = self.topology.control_group(self.topology.sequence_parallel_group)
        agree(
            {"documents of the whole sequence (cu_seq_lens_q)": list(bounds)}, group=group, op="hf_attention",
            timeout_s=self.topology.timeout_s, fix=_SAME_SEQUENCE,
        )  # fmt: skip

    def _check_mask(self, site: Site, mask: torch.Tensor, bounds: tuple[int, ...], window: int | None) -> None:
        """A mask tensor the model built itself must say no more than causal, the window and the documents."""
        tokens = shard_sequence(
            torch.arange(bounds[-1]), self.topology.sequence_parallel_group, layout=self.section.layout, dim=0
        )
        window = None if window is None or window >= bounds[-1] else window
        difference = check_mask_tensor(mask, tokens, bounds, self.section.causal, window)
        if difference is not None:
            raise ValueError(
                f"{site.module} is given {difference}, which ds_ring's attention (causal "
                f"{self.section.causal}, window {window}, the batch's documents) does not compute; ds_ring cannot "
                f"run this attention sequence-parallel: train this model without sequence parallelism"
            )

    def _check_positions(self, position_ids: torch.Tensor, bounds: tuple[int, ...]) -> None:
        """The model's RoPE used ``position_ids``: they must be this rank's tokens' positions in their documents.

        A model called without them makes ``arange(s/p)`` on every rank, right for rank 0 only. Checked on the
        first call of each shape and documents (a host read), not after.
        """
        tokens = shard_sequence(
            torch.arange(bounds[-1]), self.topology.sequence_parallel_group, layout=self.section.layout, dim=0
        )
        expected = document_positions(bounds, tokens).to(position_ids.device)
        if not bool((position_ids == expected).all()):
            raise ValueError(
                f"position_ids on sequence-parallel rank {self.topology.get_sequence_parallel_rank()} are not the "
                f"positions of its tokens (expected {_show(expected)}, got {_show(position_ids[0])}); call the "
                f"model with position_ids from ds_ring.integrations.hf.shard_batch"
            )


def _config_name(module: nn.Module) -> str:
    """The class name of ``module``'s config, for errors (under ``torch.compile``: ``<module class>.config``, since
    torch 2.6's compiler cannot take the ``type()`` of a transformers config)."""
    if torch.compiler.is_compiling():
        return f"{type(module).__name__}.config"
    return type(getattr(module, "config", module)).__name__


_SAME_SEQUENCE = (
    "the ranks of a sequence-parallel group hold shards of one shared sequence and must pass its documents "
    "alike; shard one batch for the whole group (shard_batch, SequenceParallelDataLoader or "
    "UlyssesSPDataLoaderAdapter, which runs every rank's sample in turn) rather than a different sample per rank"
)


def _show(positions: torch.Tensor) -> str:
    values = positions.tolist()
    return str(values) if len(values) <= 8 else f"[{', '.join(map(str, values[:4]))}, ..., {values[-1]}]"
