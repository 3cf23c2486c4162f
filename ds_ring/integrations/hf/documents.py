"""Documents of a packed batch, from its position ids (pure tensor functions, no communication).

A packed row holds several documents one after another; its ``position_ids`` count ``0, 1, 2, ...``
inside each document and restart at 0 where the next one begins (what transformers'
``DataCollatorWithFlattening`` makes). ds_ring takes the boundaries as ``cu_seqlens``
``[0, e1, ..., S]`` over the whole sequence, the same for every row (docs/design.md §Packed sequences).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "IGNORE_INDEX",
    "DOCUMENTS_KEY",
    "Documents",
    "document_bounds",
    "document_positions",
    "shift_labels",
    "refuse_padding",
]

IGNORE_INDEX = -100
"""Label of a token that is not counted (transformers' and PyTorch's convention)."""

DOCUMENTS_KEY = "ds_ring_cu_seqlens"
"""The batch key (a model kwarg transformers forwards to the attention) holding the :class:`Documents` of the
whole sequence: the attention reads them with no device sync."""


@dataclass(frozen=True)
class Documents:
    """Document boundaries ``(0, e1, ..., S)`` of the whole sequence as Python ints, as a batch carries them.

    Not a tuple on purpose: helpers that move a batch to a device (``move_to_device`` of DeepSpeed, ``Trainer``'s
    ``_prepare_input``, accelerate's ``send_to_device``) recurse into tuples and call ``.to`` on what they find;
    this object's ``to`` returns itself.
    """

    bounds: tuple[int, ...]

    def to(self, *args: object, **kwargs: object) -> Documents:
        return self


def document_bounds(position_ids: torch.Tensor) -> list[int]:
    """Document boundaries ``[0, e1, ..., S]`` of full-sequence ``position_ids [batch, S]``.

    Raises:
        ValueError: positions that do not count ``0, 1, 2, ...`` within each document (a reset to 0
            starts the next one), or rows whose documents start at different places.
    """
    starts = position_ids == 0
    counting = position_ids[:, 1:] == position_ids[:, :-1] + 1
    valid = torch.cat([starts[:, :1], counting | starts[:, 1:]], dim=1)
    if not bool(valid.all()):
        row, index = (int(i) for i in (~valid).nonzero()[0])
        before = f" after {int(position_ids[row, index - 1])}" if index else ""
        raise ValueError(
            f"position_ids must count 0, 1, 2, ... within each document and restart at 0 where the next "
            f"document begins; row {row} has {int(position_ids[row, index])} at index {index}{before}. Build them "
            f"per document (torch.arange(len(doc))), or leave position_ids out for one document per row"
        )
    differs = (starts != starts[:1]).any(dim=1)
    if bool(differs.any()):
        row = int(differs.nonzero()[0])
        first, other = (starts[r].nonzero().flatten().tolist() for r in (0, row))
        raise ValueError(
            f"every row of a batch must hold its documents at the same places (ds_ring's cu_seqlens is shared by "
            f"the rows); documents start at {first} in row 0 but at {other} in row {row}. Pack every row alike, "
            f"or use batch size 1 per sequence-parallel group"
        )
    return [*starts[0].nonzero().flatten().tolist(), position_ids.shape[1]]


def document_positions(bounds: Sequence[int], indices: torch.Tensor) -> torch.Tensor:
    """The position within its document of every token index in ``indices`` (any shape)."""
    starts = torch.tensor(bounds[:-1], dtype=indices.dtype, device=indices.device)
    return indices - starts[torch.searchsorted(starts, indices, right=True) - 1]


def shift_labels(labels: torch.Tensor, bounds: Sequence[int], ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``labels [batch, S]`` moved left by one: token ``i`` is labelled with token ``i + 1``'s label.

    The last token of every document (the sequence's last token included) has no next token in its
    document and gets ``ignore_index``.
    """
    shifted = torch.full_like(labels, ignore_index)
    shifted[:, :-1] = labels[:, 1:]
    shifted[:, [end - 1 for end in bounds[1:]]] = ignore_index
    return shifted


def refuse_padding(attention_mask: torch.Tensor | None) -> None:
    """``ValueError`` when a 2-D ``attention_mask [batch, seq]`` masks any token (padding)."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            "attention_mask has zeros (padded tokens): ds_ring attends over whole sequences and ignores the "
            "mask; pack the documents instead (position_ids restarting at 0 mark where each begins), or keep "
            "the padding tokens, give them label -100 and drop attention_mask"
        )
