"""The attention function ds_ring puts in transformers' registry, and the model features it refuses.

transformers' attention modules (``LlamaAttention``, ``Qwen2Attention``, ...) project, apply RoPE,
then call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, dropout=,
scaling=, **kwargs)`` with ``q [b, heads, s, d]``, ``k, v [b, kv_heads, s, d]`` and expect
``(out [b, s, heads, d], weights)`` back. Under sequence parallelism ``s`` is this rank's shard and
:class:`SequenceParallelAttention` answers with ``ds_ring.sequence_parallel_attention``. Nothing
here imports transformers.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ds_ring.integrations.hf.audit import CallAudit, ModelWatch
from ds_ring.integrations.hf.compiled import Site, attention_handle, compiled_attention
from ds_ring.integrations.hf.documents import DOCUMENTS_KEY, Documents, document_positions
from ds_ring.integrations.hf.masks import Blocks, MaskSpec, check_mask_tensor
from ds_ring.integrations.internal import (
    SECTION,
    RingAttentionConfig,
    Topology,
    agree,
    attend,
    parameter_gradient_scale,
    shard_sequence,
    topology_placement,
)

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
        """What ds_ring's losses scale each rank's gradient share by for the engine of the model that calls this
        (:func:`ds_ring.engine.gradient_scale.parameter_gradient_scale`), read off the first module's parameters at its
        first call; the session's :attr:`~ds_ring.integrations.hf.session.SequenceParallelSession.gradient_scale`."""
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
        self.vision: Any = None
        """A vision-language model's :class:`~ds_ring.integrations.hf.vision.VisionLanguage` (``None``: none): its
        vision tower's attention runs over images, answered by :attr:`original`."""
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
        if self.vision is not None and self.vision.whole_image(module):
            return self._whole_image(module, query, key, value, attention_mask, dropout, scaling, kwargs)
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
        if self.watch is not None or self.vision is not None:
            model = self.watch.batch if self.watch is not None else {}
            cut = self.vision.batch if self.vision is not None else {}
            kwargs = {**model, **cut, **{k: v for k, v in kwargs.items() if v is not None}}
        spec = attention_mask if isinstance(attention_mask, MaskSpec) else None
        if spec is not None:  # the mask is the truth (eager and sdpa follow it, not the sliding_window argument)
            sliding_window = spec.window
        self._refuse_features(module, dropout, softcap, spec, kwargs)
        if torch.compiler.is_compiling() or self.gradient_scale is None:  # compiled: read in every trace, since a
            self._read_gradient_scale(module)  # guard on the None the first trace saw fails at the next step
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
            self._check_positions(self._token_positions(site, kwargs["position_ids"]), bounds)
            if spec is not None and spec.blocks is not None and spec.blocks.columns != bounds[-1]:
                self._agree_on_sharded_blocks(site.module, spec.blocks)
            if isinstance(attention_mask, torch.Tensor):
                self._check_mask(site, attention_mask, bounds, sliding_window)
            self._checked[checked] = None
            if len(self._checked) > _CHECKED_KEPT:
                self._checked.popitem(last=False)
        window = None if sliding_window is None or sliding_window >= bounds[-1] else sliding_window
        spans = None if spec is None or spec.blocks is None else _spans(site.module, spec.blocks, bounds, window)
        dense = {"segment_lengths": None, "dilation_rates": None} if window is not None else {}
        documents = bounds if len(bounds) > 2 else None
        call = dataclasses.replace(self.section.call(), **dense, scale=scaling, window=window, softcap=softcap,
                                   cu_seqlens=documents, sinks=kwargs.get("s_aux"),
                                   bidirectional_spans=spans)  # fmt: skip
        q, k, v = (x.transpose(1, 2) for x in (query, key, value))
        return attend(q, k, v, call, topology_placement(self.topology), self.section.strategy)

    def _whole_image(
        self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any,
        dropout: float, scaling: float | None, kwargs: dict,
    ) -> tuple[torch.Tensor, Any]:  # fmt: skip
        """A vision tower's attention over one image (or its images' own blocks): the replaced attention, whole."""
        if self.original is None:
            raise ValueError(
                f"{type(module).__name__} attends over images, not over the sharded sequence, and the 'ds_ring' entry "
                f"replaces no attention of transformers' to run it with; register over the implementation the model "
                f"uses (e.g. 'sdpa')"
            )
        if isinstance(mask, MaskSpec):
            raise ValueError(
                f"{type(module).__name__} attends over images but is given a mask ds_ring made for the sharded "
                f"sequence (its config is not one of the vision tower's); train this model without sequence "
                f"parallelism"
            )
        own = {k: v for k, v in kwargs.items() if k != DOCUMENTS_KEY}
        return self.original(module, query, key, value, mask, dropout=dropout, scaling=scaling, **own)

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

    def _agree_on_sharded_blocks(self, name: str, blocks: Blocks) -> None:
        """Image spans built from each rank's shard of ``token_type_ids``: every rank of the group raises, or none
        (when no shard holds an image token), so no rank waits on one that refused."""
        agree(
            {"image tokens in this rank's shard of token_type_ids": any(blocks.rows)},
            group=self.topology.control_group(self.topology.sequence_parallel_group), op="hf_attention",
            timeout_s=self.topology.timeout_s, fix=_sharded_ids(name, blocks, "each rank"),
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

    def _token_positions(self, site: Site, position_ids: torch.Tensor) -> torch.Tensor:
        """The token positions of the ``position_ids`` a layer passes its attention: those ids themselves, or, for
        MRoPE ids ``[axes, b, s/p]`` a vision-language model's language model hands its layers (GLM-4V-MoE: it read
        its rotary from them; the attention reads no positions), the text positions of ds_ring's cut
        (:meth:`~ds_ring.integrations.hf.vision.VisionLanguage.text_positions`)."""
        if position_ids.dim() != 3:
            return position_ids
        text = None if self.vision is None else self.vision.text_positions(position_ids)
        if text is None:
            raise ValueError(
                f"{site.module} is given 3-D position_ids {list(position_ids.shape)} that are not the MRoPE rows of "
                f"the ids ds_ring's cut handed the language model, so ds_ring cannot tell its tokens' positions; "
                f"{_POSITIONS_FIX}"
            )
        return text

    def _check_positions(self, position_ids: torch.Tensor, bounds: tuple[int, ...]) -> None:
        """The model's RoPE used ``position_ids``: they must be this rank's tokens' positions in their documents, plus
        one offset that every rank of the group has (PaliGemma counts from 1; RoPE sees only differences).

        A model called without them makes ``arange(s/p)`` on every rank, right for rank 0 only: the ranks' offsets
        differ, and every rank raises. Checked on the first call of each shape and documents (a host read and one
        small exchange), not after.
        """
        tokens = shard_sequence(
            torch.arange(bounds[-1]), self.topology.sequence_parallel_group, layout=self.section.layout, dim=0
        )
        expected = document_positions(bounds, tokens).to(position_ids.device)
        offsets = (position_ids - expected).flatten()
        offset = int(offsets[0]) if bool((offsets == offsets[0]).all()) else None
        agree(
            {"position_ids minus the positions of the rank's tokens": "not one offset" if offset is None else offset},
            group=self.topology.control_group(self.topology.sequence_parallel_group), op="hf_positions",
            timeout_s=self.topology.timeout_s, fix=_POSITIONS_FIX,
        )  # fmt: skip
        if offset is None:
            got = position_ids.reshape(-1, position_ids.shape[-1])[0]
            raise ValueError(
                f"position_ids on sequence-parallel rank {self.topology.get_sequence_parallel_rank()} are not the "
                f"positions of its tokens plus one offset (expected {_show(expected)}, got {_show(got)}); "
                f"{_POSITIONS_FIX}"
            )


def _config_name(module: nn.Module) -> str:
    """The class name of ``module``'s config, for errors (under ``torch.compile``: ``<module class>.config``, since
    torch 2.6's compiler cannot take the ``type()`` of a transformers config)."""
    if torch.compiler.is_compiling():
        return f"{type(module).__name__}.config"
    return type(getattr(module, "config", module)).__name__


_POSITIONS_FIX = "call the model with position_ids from ds_ring.integrations.hf.shard_batch"

_SAME_SEQUENCE = (
    "the ranks of a sequence-parallel group hold shards of one shared sequence and must pass its documents "
    "alike; shard one batch for the whole group (shard_batch, SequenceParallelDataLoader or "
    "UlyssesSPDataLoaderAdapter, which runs every rank's sample in turn) rather than a different sample per rank"
)


def _show(positions: torch.Tensor) -> str:
    values = positions.tolist()
    return str(values) if len(values) <= 8 else f"[{', '.join(map(str, values[:4]))}, ..., {values[-1]}]"


def _spans(
    name: str, blocks: Blocks, bounds: tuple[int, ...], window: int | None
) -> tuple[tuple[int, int], ...] | None:  # docs/models.md §Vision-language masks
    """The bidirectional spans of a mask's blocks (image tokens, a prefix) over the whole sequence (documents
    ``bounds``), the same for every batch row; ``ValueError`` naming the module and the fix where they cannot be
    computed."""
    seq = bounds[-1]
    if not any(blocks.rows):  # no image token (Gemma 4's text-only batches: every id -1; agreed when sharded)
        return None
    if blocks.remapped and len(bounds) > 2:
        raise ValueError(
            f"{name} is given image spans that transformers indexes by positions within each packed document "
            f"(remap_positions_for_packed_sequence over an OR of masks), not by the spans' own tokens; ds_ring "
            f"computes spans by token: train this model on unpacked batches"
        )
    if blocks.columns != seq:
        raise ValueError(_sharded_ids(name, blocks, "this rank"))
    if len(set(blocks.rows)) > 1:
        raise ValueError(
            f"{name} is given image spans that differ between the batch's {len(blocks.rows)} rows; ds_ring computes "
            f"one set of spans per call (as one set of documents): train with micro-batches of one row, or of rows "
            f"with the same image layout"
        )
    spans = blocks.rows[0]
    longest = max((stop - start for start, stop in spans), default=0)
    if window is not None and longest > window:
        raise ValueError(
            f"{name} is a sliding-window layer (window {window}) given an image span of {longest} tokens: ds_ring "
            f"computes AND(window, OR(causal, image spans)) for spans no longer than the window; use a sliding_window "
            f"of at least {longest}, or train this model without sequence parallelism"
        )
    return spans or None


def _sharded_ids(name: str, blocks: Blocks, where: str) -> str:
    return (
        f"{name} is given image spans (blockwise_overlay) over {blocks.columns} tokens, not the whole sequence: the "
        f"model built them from {where}'s shard of its token_type_ids, where a span crossing a shard boundary cannot "
        f"be told from two; give the model its token_type_ids whole: shard_batch(session, batch, "
        f"whole=('token_type_ids',))"
    )
