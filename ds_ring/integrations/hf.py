"""Hugging Face transformers models, sequence-parallel through ds_ring (a drop-in for DeepSpeed's ALST).

DeepSpeed's ALST (``deepspeed.runtime.sequence_parallel.ulysses_sp``) overwrites transformers'
attention registry entry with a Ulysses wrapper and shards the data loader's batches; it offers
Ulysses only, dense only. This module plugs into the same place with every ds_ring strategy
(``ring``, ``allgather``, ``ulysses``, ``hybrid``), dense or LongNet-dilated, chosen by the
ds_config's ``ring_attention`` section::

    from ds_ring.integrations.hf import SequenceParallelDataLoader, causal_lm_loss, register_with_transformers

    engine, *_ = ds_ring.initialize(model=model, optimizer=optimizer, config="ds_config.json")
    topology = register_with_transformers(config="ds_config.json", topology=engine.mpu)
    for batch in SequenceParallelDataLoader(loader, topology):     # full batches in, this rank's shards out
        loss = causal_lm_loss(engine(**batch).logits, batch["shift_labels"], topology)
        engine.backward(loss)
        engine.step()

Every rank of a sequence-parallel group must load the same full batches (a sampler over the
data-parallel replicas: ``topology.get_data_parallel_world_size()`` / ``get_data_parallel_rank()``).
Gradients follow ds_ring's contract: each rank's gradient is its tokens' share, and the sum over the
sequence group (what ZeRO's reduction does) is the whole model's gradient.

transformers is imported on first use (``pip install ds_ring[hf]``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ds_ring.config import SECTION, RingAttentionConfig, load_config
from ds_ring.integrations.hf_attention import SequenceParallelAttention, check_model_config, refuse_padding
from ds_ring.integrations.packing import IGNORE_INDEX, document_bounds, shift_labels
from ds_ring.loss import sequence_parallel_cross_entropy
from ds_ring.sharding import layout_chunks, shard_sequence
from ds_ring.topology import Topology

__all__ = [
    "register_with_transformers",
    "unregister_from_transformers",
    "shard_batch",
    "SequenceParallelDataLoader",
    "causal_lm_loss",
]

# Keys of a full batch that shard_batch consumes: the mask (refused unless all ones) and labels
# become shift_labels; documents are re-derived from position_ids.
_CONSUMED = ("labels", "attention_mask", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@dataclass(frozen=True)
class _Registration:
    """What :func:`register_with_transformers` installed, and how to put back what it replaced."""

    section: RingAttentionConfig
    topology: Topology
    replaced: tuple[tuple[Any, str, bool, Any], ...]  # (interface, key, had its own entry, that entry)


_active: _Registration | None = None


def register_with_transformers(
    model_name_or_path: Any = None,
    *,
    core_attn_implementation: str = "sdpa",
    config: str | os.PathLike | Mapping[str, Any] | None = None,
    topology: Topology | None = None,
    disable_in_eval: bool = False,
) -> Topology:
    """Make transformers' ``core_attn_implementation`` attention run ds_ring sequence-parallel attention.

    Like ALST's ``UlyssesSPAttentionHF.register_with_transformers``: the registry entry every model
    with ``config._attn_implementation == core_attn_implementation`` calls is replaced (models built
    before or after), so the model's own code paths for that implementation stay as they are. The
    replacement converts HF's ``[b, heads, s, d]`` to ds_ring's ``[b, s, heads, d]`` and back, passes
    GQA K/V heads without repeating them, uses the model's ``scaling`` and returns ``(out, None)``.
    Unless ``disable_in_eval``, the mask transformers would build for that implementation is not
    built either (the attention needs none). A second call replaces the first.

    Args:
        model_name_or_path: optional: a model, a config, or a model name / local directory whose
            config is read (nothing else) to check heads and features now, before any communication.
        core_attn_implementation: the registry entry to replace: ``"sdpa"``, ``"flash_attention_2"``, ...
        config: the whole ds_config (JSON path or dict); its ``ring_attention`` section chooses
            strategy, communication, layout, segment_lengths, dilation_rates and degrees. ``None``:
            dense ring attention over every rank. A ds_config without the section (or with
            ``enabled: false``) registers nothing and gives a data-parallel-only topology.
        topology: the process groups to use (e.g. ``engine.mpu`` after ``ds_ring.initialize``); its
            degrees must be the section's. ``None``: built from the section, starting
            ``torch.distributed`` from the launcher's environment if it is not started.
        disable_in_eval: ``model.eval()`` runs the original attention on whole sequences.

    Returns:
        The :class:`ds_ring.Topology`: the ``mpu`` for ``deepspeed.initialize``, and what
        :func:`shard_batch`, :class:`SequenceParallelDataLoader` and :func:`causal_lm_loss` take.

    Raises:
        ValueError: before any communication, naming the field and the fix: ``eager`` or an unknown
            implementation, a model config with a sliding window, logit soft-capping or heads the
            strategy cannot split, a malformed section, or a topology with other degrees.
    """
    global _active
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    section = _section(config)
    _check_implementation(core_attn_implementation, ALL_ATTENTION_FUNCTIONS)
    model_config = _model_config(model_name_or_path, core_attn_implementation)
    if topology is None and not dist.is_initialized():
        from ds_ring.engine import init_distributed

        init_distributed(section.timeout_s)
    world_size = topology.world_size if topology is not None else dist.get_world_size()
    if model_config is not None and section.enabled:
        check_model_config(model_config, section, world_size)
    degrees = section.degrees(world_size)
    if topology is None:
        topology = Topology.from_config(section, world_size)
    elif degrees != (topology.data_parallel, topology.ulysses, topology.ring):
        raise ValueError(
            f"topology has data_parallel {topology.data_parallel} × ulysses {topology.ulysses} × ring "
            f"{topology.ring} but {SECTION} gives {' × '.join(map(str, degrees))}; pass the topology built from "
            f"this ds_config (engine.mpu of ds_ring.initialize), or topology=None"
        )
    unregister_from_transformers()
    replaced = []
    if section.enabled:
        original = ALL_ATTENTION_FUNCTIONS[core_attn_implementation]
        attention = SequenceParallelAttention(section, topology, original, disable_in_eval=disable_in_eval)
        replaced.append(_replace(ALL_ATTENTION_FUNCTIONS, core_attn_implementation, attention))
        if not disable_in_eval and core_attn_implementation in ALL_MASK_ATTENTION_FUNCTIONS:
            replaced.append(_replace(ALL_MASK_ATTENTION_FUNCTIONS, core_attn_implementation, _no_mask))
    _active = _Registration(section, topology, tuple(replaced))
    return topology


def unregister_from_transformers() -> None:
    """Put back exactly the registry entries :func:`register_with_transformers` replaced (no-op if none)."""
    global _active
    if _active is None:
        return
    for interface, key, had_entry, entry in reversed(_active.replaced):
        if had_entry:
            interface[key] = entry
        else:
            del interface[key]
    _active = None


def shard_batch(batch: Mapping[str, Any], topology: Topology, *, pad_to_multiple: bool = False) -> dict[str, Any]:
    """This rank's part of a full-sequence batch, for a model registered with :func:`register_with_transformers`.

    Args:
        batch: ``input_ids [b, S]``; optional ``labels [b, S]`` (default: ``input_ids``),
            ``position_ids [b or 1, S]`` (default ``arange(S)``; restarting at 0 where a packed
            document begins), ``attention_mask [b, S]`` of ones; any other ``[b, S, ...]`` tensor is
            sharded alike, anything not a tensor copied.
        topology: the registered topology.
        pad_to_multiple: pad ``S`` up to a multiple of the layout's chunk count (pad tokens get label
            -100 and never reach a counted token), rather than raise.

    Returns:
        ``input_ids``, ``position_ids`` (global positions, in the registered section's layout,
        zigzag included) and ``shift_labels`` ``[b, S/p]`` (labels moved left by one *before*
        sharding; -100 where a token has no next token in its document), and ``cu_seq_lens_q`` =
        ``cu_seq_lens_k`` (int32 ``[0, e1, ..., S]``: the documents of the whole sequence, the same on
        every rank; transformers forwards them to the attention). Call the model with all of it.

    Raises:
        ValueError: no ``input_ids``, a mask with zeros, position ids that do not count up from 0 per
            document or rows packed differently, a tensor of another length, or a length that does
            not split into the layout's chunks (without ``pad_to_multiple``) — naming the multiple.
    """
    section = _active.section if _active is not None else RingAttentionConfig(enabled=False)
    input_ids = batch.get("input_ids")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"batch['input_ids'] must be a [batch, seq] tensor, got {_describe(input_ids)}")
    rows, seq_len = input_ids.shape
    refuse_padding(batch.get("attention_mask"))
    positions = batch.get("position_ids")
    positions = torch.arange(seq_len, device=input_ids.device)[None] if positions is None else positions
    positions = _sequence_tensor(batch, "position_ids", positions, rows, seq_len).expand(rows, seq_len)
    bounds = document_bounds(positions)
    labels = _sequence_tensor(batch, "labels", batch.get("labels", input_ids), rows, seq_len)
    sequences = {"input_ids": input_ids, "shift_labels": shift_labels(labels, bounds)}
    copied = {}
    for key, value in batch.items():
        if key in _CONSUMED or key in sequences or key == "position_ids":
            continue
        if isinstance(value, torch.Tensor):
            sequences[key] = _sequence_tensor(batch, key, value, rows, seq_len)
        else:
            copied[key] = value

    sp = topology.get_sequence_parallel_world_size()
    multiple = sp * len(layout_chunks(0, sp, section.layout))
    pad = -seq_len % multiple
    if pad and not pad_to_multiple:
        raise ValueError(
            f"sequence length {seq_len} does not split into {multiple} equal chunks (sequence_parallel_size {sp}"
            f"{', ×2 for zigzag' if section.layout == 'zigzag' else ''}); make lengths a multiple of {multiple}, "
            f"or pass pad_to_multiple=True"
        )
    if pad:
        sequences = {
            key: _pad(value, pad, IGNORE_INDEX if key == "shift_labels" else 0) for key, value in sequences.items()
        }
        positions, bounds = _pad_positions(positions, bounds, pad, causal=section.causal)

    group = topology.sequence_parallel_group
    sharded = {key: shard_sequence(value, group, layout=section.layout, dim=1) for key, value in sequences.items()}
    sharded["position_ids"] = shard_sequence(positions.contiguous(), group, layout=section.layout, dim=1)
    documents = torch.tensor(bounds, dtype=torch.int32, device=input_ids.device)
    return {**copied, **sharded, "cu_seq_lens_q": documents, "cu_seq_lens_k": documents}


class SequenceParallelDataLoader:
    """Wraps a data loader of full-sequence dict batches; yields :func:`shard_batch` of each.

    The equivalent of ALST's ``UlyssesSPDataLoaderAdapter``, without its communication: every rank
    of a sequence-parallel group must load the same batches. ``len()`` is the wrapped loader's.
    ``device``: where the sharded tensors go (``None``: where the loader put them).
    """

    def __init__(
        self,
        dataloader: Iterable[Mapping[str, Any]],
        topology: Topology,
        *,
        pad_to_multiple: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        self.dataloader = dataloader
        self.topology = topology
        self.pad_to_multiple = pad_to_multiple
        self.device = device

    def __len__(self) -> int:
        return len(self.dataloader)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.dataloader:
            sharded = shard_batch(batch, self.topology, pad_to_multiple=self.pad_to_multiple)
            if self.device is not None:
                sharded = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in sharded.items()}
            yield sharded


def causal_lm_loss(logits: torch.Tensor, shift_labels: torch.Tensor, topology: Topology) -> torch.Tensor:
    """Mean cross-entropy over every counted token of the whole sequence group.

    Args:
        logits: this rank's ``[b, S/p, vocab]`` (computed in fp32; fp64 stays fp64).
        shift_labels: this rank's ``[b, S/p]`` from :func:`shard_batch` (-100: not counted).
        topology: the registered topology.

    Returns:
        A scalar, the same on every rank, equal to ``model(input_ids, labels=labels).loss`` of the
        whole model on the full batch. Its gradient on each rank is that rank's tokens' share: the
        sum over the sequence group is the whole model's gradient (no division by the group size).
    """
    return sequence_parallel_cross_entropy(logits, shift_labels, topology)


def _section(config: str | os.PathLike | Mapping[str, Any] | None) -> RingAttentionConfig:
    if config is None:
        return RingAttentionConfig()
    if isinstance(config, Mapping) and SECTION not in config and "strategy" in config:
        raise ValueError(
            f"config must be a whole ds_config (with a {SECTION!r} section), got what looks like the section "
            f"itself; pass {{{SECTION!r}: {{...}}, ...}}"
        )
    section = load_config(config)
    if not section.enabled:  # every attention on the whole sequence its rank holds
        return RingAttentionConfig(enabled=False, sequence_parallel_size=1, timeout_s=section.timeout_s)
    return section


def _check_implementation(name: str, registry: Mapping[str, Any]) -> None:
    if name == "eager" or name.endswith("|eager"):
        raise ValueError(
            f"core_attn_implementation {name!r} materialises [seq, seq] attention weights and cannot run sequence "
            f"parallel; use 'sdpa' (build the model with attn_implementation='sdpa') or a flash attention"
        )
    if name not in registry:
        raise ValueError(f"core_attn_implementation {name!r} is not one of transformers' {sorted(registry)}")


def _model_config(model_name_or_path: Any, implementation: str) -> Any:
    """The model's config: from a model, a config, or a name / directory (``AutoConfig``); ``None`` if none."""
    if model_name_or_path is None:
        return None
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model_name_or_path, PretrainedConfig):
        return model_name_or_path
    if hasattr(model_name_or_path, "config"):  # a built model: check the implementation it calls
        config = model_name_or_path.config
        used = getattr(config, "_attn_implementation", None)
        if used != implementation:
            raise ValueError(
                f"the model's config._attn_implementation is {used!r} but core_attn_implementation is "
                f"{implementation!r}; build the model with attn_implementation={implementation!r} (or register "
                f"{used!r}) so that its attention calls the replaced entry"
            )
        return config
    return AutoConfig.from_pretrained(model_name_or_path)


def _replace(interface: Any, key: str, value: Any) -> tuple[Any, str, bool, Any]:
    """Set ``interface[key]`` (the instance's own entry, as ALST does); return how to undo it."""
    own = interface._local_mapping  # GeneralInterface: the instance's entries override the class-wide ones
    undo = (interface, key, key in own, own.get(key))
    interface[key] = value
    return undo


def _no_mask(*, attention_mask: torch.Tensor | None = None, **_: Any) -> None:
    """The mask function of the replaced implementation: ds_ring needs no mask, so none is built."""
    refuse_padding(attention_mask)
    return None


def _describe(value: Any) -> str:
    return f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


def _sequence_tensor(batch: Mapping[str, Any], key: str, value: Any, rows: int, seq_len: int) -> torch.Tensor:
    """``value`` checked to be ``[rows (or 1 for position_ids), seq_len, ...]``."""
    ok_rows = (rows, 1) if key == "position_ids" else (rows,)
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[0] not in ok_rows:
        raise ValueError(
            f"batch[{key!r}] must be a [batch, seq, ...] tensor like input_ids {tuple(batch['input_ids'].shape)}, "
            f"got {_describe(value)}"
        )
    if value.shape[1] != seq_len:
        raise ValueError(
            f"batch[{key!r}] has {value.shape[1]} tokens per row but input_ids has {seq_len}; give every "
            f"sequence tensor the same length"
        )
    return value


def _pad(value: torch.Tensor, pad: int, fill: int) -> torch.Tensor:
    tail = value.new_full((value.shape[0], pad, *value.shape[2:]), fill)
    return torch.cat([value, tail], dim=1)


def _pad_positions(
    positions: torch.Tensor, bounds: list[int], pad: int, *, causal: bool
) -> tuple[torch.Tensor, list[int]]:
    """Positions of ``pad`` appended tokens, and the documents afterwards.

    Causal: they continue the last document (no counted token sees a later one). Otherwise they form
    a document of their own, so no counted token attends to them.
    """
    steps = torch.arange(pad, dtype=positions.dtype, device=positions.device).expand(positions.shape[0], pad)
    end = bounds[-1] + pad
    if causal:
        return torch.cat([positions, positions[:, -1:] + 1 + steps], dim=1), [*bounds[:-1], end]
    return torch.cat([positions, steps], dim=1), [*bounds, end]
