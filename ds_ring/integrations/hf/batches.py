"""Batches for a sequence-parallel Hugging Face model: full batches in, this rank's shard out.

:func:`shard_batch` turns a full-sequence batch into this rank's ``input_ids``, global ``position_ids``,
labels shifted before sharding, and the documents of a packed batch; :class:`SequenceParallelDataLoader`
applies it to every batch of a loader. Nothing here runs inside the model.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from ds_ring.integrations.hf.documents import (
    DOCUMENTS_KEY,
    IGNORE_INDEX,
    Documents,
    document_bounds,
    refuse_padding,
    shift_labels,
)
from ds_ring.integrations.hf.session import SequenceParallelSession, require_session
from ds_ring.integrations.internal import Topology, agree, all_gather, group_members, shard_sequence
from ds_ring.integrations.internal import order_chunks as layout_chunks

__all__ = ["shard_batch", "agree_on_batch", "gather_batches", "SequenceParallelDataLoader"]

_FINGERPRINTED = ("input_ids", "labels", "position_ids", "attention_mask")

# Keys of a full batch that shard_batch consumes: the mask (refused unless all ones) and labels
# become shift_labels; documents are re-derived from position_ids.
_CONSUMED = (
    "labels",
    "attention_mask",
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "max_length_q",
    "max_length_k",
    DOCUMENTS_KEY,
)


def shard_batch(
    session: SequenceParallelSession,
    batch: Mapping[str, Any],
    *,
    pad_to_multiple: bool = False,
    check_same: bool = True,
    whole: tuple[str, ...] = (),
) -> dict[str, Any]:
    """This rank's part of a full-sequence batch, for a model registered with :func:`register_with_transformers`.

    Collective over the session's sequence-parallel group (unless ``check_same=False``): every rank of it
    must pass the same full batch, which one small exchange checks before anything else (shapes and a
    blake2b digest of ``input_ids``, ``labels``, ``position_ids``, ``attention_mask``; the digest reads a
    device tensor back to the host, once per batch).

    Args:
        session: what :func:`register_with_transformers` returned (its section's layout and causality, its topology).
        batch: ``input_ids [b, S]``; optional ``labels [b, S]`` (default: ``input_ids``),
            ``position_ids [b or 1, S]`` (default ``arange(S)``; restarting at 0 where a packed
            document begins), ``attention_mask [b, S]`` of ones; any other ``[b, S, ...]`` tensor is
            sharded alike, anything not a tensor copied.
        pad_to_multiple: pad ``S`` up to a multiple of the layout's chunk count (pad tokens get label
            -100 and never reach a counted token), rather than raise.
        check_same: agree that the group's ranks hold the same batch (``False`` only where they do by
            construction, e.g. batches the ranks gathered from one another).
        whole: keys of ``[b, S]`` tensors given to the model whole rather than sharded: inputs it reads only to build
            its attention mask over the whole sequence, e.g. ``("token_type_ids",)`` for Gemma 3's image spans and
            PaliGemma's prefix, which ds_ring's attention then reads from the mask function (docs/models.md
            §Vision-language masks).

    Returns:
        ``input_ids``, ``position_ids`` (global positions, in the session's section's layout,
        zigzag included) and ``shift_labels`` ``[b, S/p]`` (labels moved left by one *before*
        sharding; -100 where a token has no next token in its document), ``cu_seq_lens_q`` =
        ``cu_seq_lens_k`` (int32 ``[0, e1, ..., S]``: the documents of the whole sequence, the same on
        every rank) and ``ds_ring_cu_seqlens`` (the same as Python ints, :class:`Documents`, which the attention
        reads without a device sync); transformers forwards them to the attention. Call the model with all of it.

    Raises:
        TypeError: ``session`` is not a session (e.g. the Topology of older releases), naming the fix.
        ValueError: a vision-language batch with a key its model's ``forward`` does not take (naming it, before any
            communication); ranks of the group holding different batches (on every rank, naming each rank's
            shapes or digest and the fix); no ``input_ids``, a mask with zeros, position ids that do not
            count up from 0 per document or rows packed differently, a tensor of another length, or a length
            that does not split into the layout's chunks (without ``pad_to_multiple``) — naming the multiple.
    """
    session = require_session(session, "shard_batch")
    section, topology = session.section, session.topology
    if session.vision is not None:
        _refuse_unknown_inputs(session, batch)
    if check_same:
        agree_on_batch(batch, topology, every_tensor=session.vision is not None)
    input_ids = batch.get("input_ids")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"batch['input_ids'] must be a [batch, seq] tensor, got {_describe(input_ids)}")
    if session.vision is not None:
        return _whole_sequence(session, batch, pad_to_multiple=pad_to_multiple)
    rows, seq_len = input_ids.shape
    refuse_padding(batch.get("attention_mask"))
    positions = batch.get("position_ids")
    positions = torch.arange(seq_len, device=input_ids.device)[None] if positions is None else positions
    positions = _sequence_tensor(batch, "position_ids", positions, rows, seq_len).expand(rows, seq_len)
    bounds = document_bounds(positions)
    labels = _sequence_tensor(batch, "labels", batch.get("labels", input_ids), rows, seq_len)
    sequences = {"input_ids": input_ids, "shift_labels": shift_labels(labels, bounds)}
    copied, kept_whole = {}, {}
    for key, value in batch.items():
        if key in _CONSUMED or key in sequences or key == "position_ids":
            continue
        if key in whole:
            kept_whole[key] = _sequence_tensor(batch, key, value, rows, seq_len)
        elif isinstance(value, torch.Tensor):
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
        kept_whole = {key: _pad(value, pad, 0) for key, value in kept_whole.items()}

    group = topology.sequence_parallel_group
    sharded = {key: shard_sequence(value, group, layout=section.layout, dim=1) for key, value in sequences.items()}
    sharded["position_ids"] = shard_sequence(positions.contiguous(), group, layout=section.layout, dim=1)
    documents = torch.tensor(bounds, dtype=torch.int32, device=input_ids.device)
    return {
        **copied,
        **kept_whole,
        **sharded,
        "cu_seq_lens_q": documents,
        "cu_seq_lens_k": documents,
        DOCUMENTS_KEY: Documents(tuple(bounds)),
    }


def _whole_sequence(
    session: SequenceParallelSession, batch: Mapping[str, Any], *, pad_to_multiple: bool
) -> dict[str, Any]:
    """:func:`shard_batch` of a vision-language model (:mod:`~ds_ring.integrations.hf.vision`): the model gets the whole
    sequence and its images (its merge and position ids need them) and cuts before its language model; only the
    labels are this rank's (``shift_labels``), with the documents the attention reads (one per row)."""
    input_ids = batch["input_ids"]
    rows, seq_len = input_ids.shape
    name = session.vision.model_class
    refuse_padding(batch.get("attention_mask"))
    sp = session.topology.get_sequence_parallel_world_size()
    multiple = sp * len(layout_chunks(0, sp, session.section.layout))
    if seq_len % multiple:
        padding = " (shard_batch does not pad a vision-language batch: pad it in the collator, label -100)"
        raise ValueError(
            f"sequence length {seq_len} does not split into {multiple} equal chunks (sequence_parallel_size {sp}"
            f"{', ×2 for zigzag' if session.section.layout == 'zigzag' else ''}); make lengths a multiple of "
            f"{multiple}{padding if pad_to_multiple else ''}"
        )
    positions = batch.get("position_ids")
    text = positions if positions is None or positions.dim() == 2 else positions[0] if positions.shape[0] == 4 else None
    if text is not None and not torch.equal(text, torch.arange(seq_len, device=text.device).expand_as(text)):
        raise ValueError(
            f"{name}: position_ids (their text row) do not count 0..{seq_len - 1} in every row: packed documents of "
            f"a vision-language model are not supported; give one sequence per row (or drop position_ids: the "
            f"model computes its own from the whole sequence)"
        )
    bounds = [0, seq_len]
    labels = _sequence_tensor(batch, "labels", batch.get("labels", input_ids), rows, seq_len)
    shifted = shard_sequence(
        shift_labels(labels, bounds), session.topology.sequence_parallel_group, layout=session.section.layout, dim=1
    )
    whole = {k: v for k, v in batch.items() if k not in _CONSUMED}
    documents = torch.tensor(bounds, dtype=torch.int32, device=input_ids.device)
    return {
        **whole,
        "shift_labels": shifted,
        "cu_seq_lens_q": documents,
        "cu_seq_lens_k": documents,
        DOCUMENTS_KEY: Documents(tuple(bounds)),
    }


def _refuse_unknown_inputs(session: SequenceParallelSession, batch: Mapping[str, Any]) -> None:
    """``ValueError`` naming each key of a vision-language batch that its model's ``forward`` does not take (and
    :func:`shard_batch` does not consume): the model would accept it in ``**kwargs`` and train without it."""
    vision = session.vision
    unknown = sorted(key for key in batch if key not in vision.inputs and key not in _CONSUMED)
    if unknown:
        raise ValueError(
            f"shard_batch: the batch's {', '.join(map(repr, unknown))} is not an input of {vision.model_class}.forward "
            f"(it takes {', '.join(sorted(vision.inputs))}): the model would take it in **kwargs and train without "
            f"it; drop it from the batch (the collator's output), or use the model class whose processor made it"
        )


_SAME_BATCH = (
    "every rank of a sequence-parallel group must load the same full batch and shard it: sample over the "
    "data-parallel replicas only (e.g. DistributedSampler(dataset, "
    "num_replicas=topology.get_data_parallel_world_size(), rank=topology.get_data_parallel_rank())), or wrap "
    "the loader in UlyssesSPDataLoaderAdapter, which gathers "
    "the ranks' batches and runs each whole in turn"
)


def agree_on_batch(batch: Mapping[str, Any], topology: Topology, *, every_tensor: bool = False) -> None:
    """Collective over the sequence-parallel group: ``ValueError`` on every rank unless all hold ``batch`` alike.

    Compared: the shapes of ``input_ids``, ``labels``, ``position_ids`` and ``attention_mask`` (with
    ``every_tensor``: of every tensor of the batch, a vision-language batch's images and grids too) and one 64-bit
    blake2b digest of their bytes (a device tensor is copied to the host for it), in one small all-gather.
    """
    shapes, digest = [], hashlib.blake2b(digest_size=8)
    keys = _FINGERPRINTED
    if every_tensor:
        keys += tuple(sorted(k for k, v in batch.items() if isinstance(v, torch.Tensor) and k not in _FINGERPRINTED))
    for key in keys:
        value = batch.get(key)
        if isinstance(value, torch.Tensor):
            shapes.append(f"{key} {list(value.shape)}")
            digest.update(key.encode())
            digest.update(value.detach().contiguous().cpu().view(torch.uint8).numpy())
    fields = {"batch shapes": ", ".join(shapes), "batch contents (blake2b)": digest.hexdigest()}
    group = topology.control_group(topology.sequence_parallel_group)
    agree(fields, group=group, op="shard_batch", timeout_s=topology.timeout_s, fix=_SAME_BATCH, cache=False)


def gather_batches(
    batch: Mapping[str, Any] | None, topology: Topology, *, batches_before: int = 0
) -> list[dict[str, Any]] | None:
    """Every sequence-parallel rank's ``batch`` (any lengths; tensors on the CPU), in sequence-parallel rank order.

    Collective over the topology's sequence-parallel group (its control group: CPU tensors): two all-gathers
    (sizes, then the batches serialised with ``torch.save``; tensors, numbers, strings and containers of them),
    bounded by the topology's timeout. ``batch=None`` says this rank's loader is exhausted (size 0 in the first
    exchange): ``None`` comes back when every rank's is.

    Raises:
        ValueError: on every rank at once, when some ranks' loaders are exhausted and others' are not, naming
            the ranks and their batch counts (``batches_before``: the batches each yielded before this one).
    """
    blob = torch.empty(0, dtype=torch.uint8)
    if batch is not None:
        buffer = io.BytesIO()
        torch.save({k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}, buffer)
        blob = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
    group, timeout_s = topology.control_group(topology.sequence_parallel_group), topology.timeout_s
    ranks = group_members(group)
    sizes = all_gather(torch.tensor([blob.numel()]), ranks, group=group, op="gather_batches", timeout_s=timeout_s)
    numels = [int(size) for size in sizes]
    ended = [rank for rank, numel in enumerate(numels) if numel == 0]
    if len(ended) == len(numels):
        return None
    if ended:
        going = [rank for rank in range(len(numels)) if rank not in ended]
        raise ValueError(
            f"UlyssesSPDataLoaderAdapter: the loaders of sequence-parallel ranks {ended} ended after "
            f"{batches_before} batches, while those of ranks {going} have batch {batches_before + 1}: every rank "
            f"of a sequence-parallel group must load as many batches (each batch runs on all of them); give every "
            f"rank a loader of the same length (e.g. DistributedSampler(..., drop_last=True))"
        )
    parts = all_gather(blob, ranks, group=group, numels=numels, op="gather_batches", timeout_s=timeout_s)
    return [torch.load(io.BytesIO(part.numpy().tobytes()), weights_only=True) for part in parts]


class SequenceParallelDataLoader:
    """Wraps a data loader of full-sequence dict batches; yields :func:`shard_batch` of each for ``session``.

    Every rank of a sequence-parallel group must load the same batches (checked on every batch:
    :func:`agree_on_batch`); ``len()`` is the wrapped loader's. To run sequence parallel over a loader
    whose ranks load different samples, use :class:`UlyssesSPDataLoaderAdapter`.
    ``device``: where the sharded tensors go (``None``: where the loader put them). ``pad_to_multiple`` and ``whole``:
    as :func:`shard_batch` takes them (a vision-language model's batch needs neither: it reaches the model whole).
    """

    def __init__(
        self,
        dataloader: Iterable[Mapping[str, Any]],
        session: SequenceParallelSession,
        *,
        pad_to_multiple: bool = False,
        device: torch.device | str | None = None,
        whole: tuple[str, ...] = (),
    ) -> None:
        self.dataloader = dataloader
        self.session = require_session(session, "SequenceParallelDataLoader")
        self.pad_to_multiple = pad_to_multiple
        self.device = device
        self.whole = whole

    def __len__(self) -> int:
        return len(self.dataloader)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.dataloader:
            sharded = shard_batch(self.session, batch, pad_to_multiple=self.pad_to_multiple, whole=self.whole)
            if self.device is not None:
                sharded = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in sharded.items()}
            yield sharded


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
