"""What a model's attention mask says, read from the mask function transformers composes, never discarded.

transformers builds every mask from an index function (``mask_function(batch, head, q, kv) -> bool``) composed
of known pieces (``causal_mask_function``, ``sliding_window_overlay(w)``, ``chunked_overlay(c)``, packing,
padding, ``and_masks`` / ``or_masks``) and hands it to the mask interface of the model's attention
implementation. ds_ring replaces that interface (:func:`mask_spec`): instead of a ``[b, 1, s, s]`` tensor the
attention receives a :class:`MaskSpec` — causal or not, and the window — read off the composition by walking the
function's closures (Python only: no tensor is made or read). A piece ds_ring cannot reproduce (a chunked or
bidirectional window, an ``or`` of masks other than causal OR image spans, a function transformers does not define)
makes the spec *unsupported*, and the attention refuses it by name on its first call.

Vision-language models OR causal attention with ``blockwise_overlay(block_sequence_ids)``: tokens of one block (Gemma
3's image, PaliGemma's image + prompt prefix) see each other fully. The spec then carries those blocks as spans
(:class:`Blocks`, read from the overlay's ids: one host read per mask function, i.e. per forward), which the
attention computes as ds_ring's bidirectional spans (docs/models.md §Vision-language masks).

A model that builds a mask tensor itself and hands it to its attention (rather than through the interface) is
checked by :func:`check_mask_tensor` on the first call of each shape: the tensor must be what causal attention,
the window and the documents give on this rank's shard, else it is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Blocks", "MaskSpec", "mask_spec", "check_mask_tensor"]

# Pieces of transformers.masking_utils, by qualified name: what each one means for ds_ring.
_CAUSAL = "causal_mask_function"
_BIDIRECTIONAL = "bidirectional_mask_function"
_WINDOW = "sliding_window_overlay.<locals>.inner_mask"
_DOCUMENTS = "packed_sequence_mask_function.<locals>.inner_mask"  # ds_ring's documents give the same mask
_COMBINATORS = {"and_masks.<locals>.and_mask", "remap_positions_for_packed_sequence.<locals>.inner_mask"}
_ADDED = "add_offsets_to_mask_function.<locals>.inner_mask"
_OR = "or_masks.<locals>.or_mask"
_BLOCKWISE = "blockwise_overlay.<locals>.inner_mask"  # OR'd with causal: bidirectional spans (image tokens)
_REMAP = "remap_positions_for_packed_sequence.<locals>.inner_mask"
_UNSUPPORTED = {
    "chunked_overlay.<locals>.inner_mask": "chunked attention (attention only inside fixed chunks)",
    "sliding_window_bidirectional_overlay.<locals>.inner_mask": "a bidirectional sliding window",
    _BLOCKWISE: "blockwise bidirectional attention outside an OR with causal attention",
    "padding_mask_function.<locals>.inner_mask": "padding",
}


@dataclass(frozen=True)
class Blocks:
    """The bidirectional blocks a mask ORs into causal attention (``blockwise_overlay``), as spans.

    ``rows``: per batch row, the ``(start, stop)`` runs of tokens sharing one block id (>= 0), over the ids' own
    columns; ``columns``: how many tokens the ids cover — the whole sequence when the model was given its
    ``token_type_ids`` whole, one shard when they were sharded with the tokens. ``remapped``: the OR sits under
    transformers' packed-sequence remap, which indexes the ids by ``position_ids`` — the global positions
    :func:`~ds_ring.integrations.hf.shard_batch` gives when the batch is one document, positions within a document
    (not the ids' columns) when it is packed.
    """

    rows: tuple[tuple[tuple[int, int], ...], ...]
    columns: int
    remapped: bool = False


@dataclass(frozen=True)
class MaskSpec:
    """A model's mask, as ds_ring computes it: ``causal`` and ``window`` (keys ``q - window < k ≤ q``; ``None``:
    no window), OR'd with ``blocks``. ``unsupported`` names a piece ds_ring cannot compute (then the attention
    refuses it)."""

    causal: bool
    window: int | None
    unsupported: str | None = None
    blocks: Blocks | None = None
    """Spans of tokens that see each other fully inside the causal mask (image tokens, a prefix); ``None``: none."""
    shape: tuple[int, int, int, int] | None = dataclasses.field(default=None, compare=False)
    """``(batch, 1, queries, keys)`` of the mask tensor the spec stands for, as the mask interface was asked for it."""
    ndim = 4
    """A built mask, as transformers' mask builders see it: a model that hands the mask on to a model that builds it
    again (PaliGemma to its Gemma) gets it back as is, as it gets a 4-D mask tensor back."""

    def __bool__(self) -> bool:  # a model testing ``if attention_mask:`` sees a mask
        return True

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle and friends probe dunders: not a use of the mask
            raise AttributeError(name)
        raise _builds_on_mask(f".{name}")

    def __getitem__(self, index: Any) -> Any:
        if all(_whole(part) for part in (index if isinstance(index, tuple) else (index,))):
            return self  # Gemma 4 slices its mask to the logits it keeps before KV-shared layers: in training, all
        raise _builds_on_mask("[...]")

    def _operator(self, *_: Any) -> Any:
        raise _builds_on_mask("arithmetic")

    __add__ = __radd__ = __mul__ = __rmul__ = __and__ = __rand__ = __or__ = __ror__ = __sub__ = __rsub__ = _operator

    @classmethod
    def __torch_function__(cls, func: Any, _types: Any, _args: Any = (), _kwargs: Any = None) -> Any:
        # a torch function given the spec where it wants a mask tensor (Falcon's own F.scaled_dot_product_attention)
        raise _builds_on_mask(f"{getattr(func, '__name__', func)}(...)")


def _whole(part: Any) -> bool:
    """Whether an index of one dimension keeps all of it (``...``, ``:``, ``0:``)."""
    return part is Ellipsis or (
        isinstance(part, slice) and part.start in (None, 0) and part.stop is None and part.step in (None, 1)
    )


class MaskUsedAsTensor(ValueError, AttributeError):
    """Model code used a :class:`MaskSpec` as a tensor: a ``ValueError`` (a refusal), and an ``AttributeError`` so
    that ``hasattr(spec, name)`` stays ``False`` for code that only probes."""


def _builds_on_mask(use: str) -> MaskUsedAsTensor:
    return MaskUsedAsTensor(
        f"the model's code uses its attention mask as a tensor ({use}): it builds on the mask itself (e.g. a "
        f"dynamic or learned mask), which ds_ring's attention does not compute; train this model without sequence "
        f"parallelism"
    )


def _pieces(function: Callable) -> Iterator[Callable]:
    """The leaf functions of a composed mask function (closure cells that are functions or tuples of them)."""
    name = getattr(function, "__qualname__", "")
    if name in _COMBINATORS or name == _ADDED:
        for cell in function.__closure__ or ():
            value = cell.cell_contents
            if callable(value):
                yield from _pieces(value)
            elif isinstance(value, tuple | list):
                for item in value:
                    if callable(item):
                        yield from _pieces(item)
        return
    yield function


def _closure_value(function: Callable, name: str) -> Any:
    return function.__closure__[function.__code__.co_freevars.index(name)].cell_contents


def mask_spec(mask_function: Callable | None) -> MaskSpec:
    """Read a transformers mask function; ``None`` (no function given) is causal attention without a window."""
    if mask_function is None:
        return MaskSpec(causal=True, window=None)
    causal, bidirectional, windows, blocks = False, False, [], None
    for piece in _pieces(mask_function):
        name = getattr(piece, "__qualname__", repr(piece))
        module = getattr(piece, "__module__", "")
        if name in _UNSUPPORTED:
            return MaskSpec(causal=True, window=None, unsupported=_UNSUPPORTED[name])
        if name == _OR:
            blocks = _or_blocks(piece)
            if isinstance(blocks, str):
                return MaskSpec(causal=True, window=None, unsupported=blocks)
            causal = True
            windows += [
                int(_closure_value(leaf, "sliding_window")) for leaf in _or_leaves(piece) if _name(leaf) == _WINDOW
            ]
        elif name == _CAUSAL:
            causal = True
        elif name == _BIDIRECTIONAL:
            bidirectional = True
        elif name == _WINDOW:
            windows.append(int(_closure_value(piece, "sliding_window")))
        elif name != _DOCUMENTS:
            return MaskSpec(causal=True, window=None, unsupported=f"a mask function of its own ({module}.{name})")
    if causal == bidirectional:
        return MaskSpec(causal=True, window=None, unsupported="a mask that is neither causal nor bidirectional")
    if windows and not causal:
        return MaskSpec(causal=False, window=None, unsupported="a window on bidirectional attention")
    if blocks is not None and _remaps_or(mask_function):
        blocks = dataclasses.replace(blocks, remapped=True)
    return MaskSpec(causal=causal, window=min(windows) if windows else None, blocks=blocks)


def _name(function: Callable) -> str:
    return getattr(function, "__qualname__", repr(function))


def _or_leaves(function: Callable) -> list[Callable]:
    return [leaf for part in _closure_value(function, "mask_functions") for leaf in _pieces(part)]


def _or_blocks(function: Callable) -> Blocks | str:
    """The blocks of ``or_masks(causal, blockwise_overlay(ids))`` (the causal side possibly wrapped, and carrying a
    sliding window in Gemma 4's ``OR(AND(window, causal), blocks)``, which equals ``AND(window, OR(causal, blocks))``
    for blocks no longer than the window — longer ones the attention refuses), or what else the OR holds, described."""
    parts = [list(_pieces(part)) for part in _closure_value(function, "mask_functions")]
    overlays = [leaves[0] for leaves in parts if len(leaves) == 1 and _name(leaves[0]) == _BLOCKWISE]
    others = [leaves for leaves in parts if not (len(leaves) == 1 and _name(leaves[0]) == _BLOCKWISE)]
    causal_side = len(others) == 1 and {_name(leaf) for leaf in others[0]} in (
        {_CAUSAL}, {_CAUSAL, _WINDOW}, {_CAUSAL, _DOCUMENTS}, {_CAUSAL, _WINDOW, _DOCUMENTS}
    )  # fmt: skip
    if len(overlays) != 1 or not causal_side:
        shown = ", ".join(_name(leaf).split(".<locals>")[0] for leaves in parts for leaf in leaves)
        return (
            f"an OR of masks ({shown}); ds_ring computes an OR of causal attention with image spans "
            f"(blockwise_overlay) only"
        )
    return _block_spans(_closure_value(overlays[0], "block_sequence_ids"))


def _block_spans(ids: torch.Tensor) -> Blocks | str:
    """Runs of equal block ids >= 0 per row of ``ids [b, n]`` (read to the host), or why they are not spans."""
    ids = ids.detach().to("cpu").reshape(-1, ids.shape[-1])
    rows = []
    for row in ids:
        edges = [0, *(torch.nonzero(row[1:] != row[:-1]).flatten() + 1).tolist(), row.numel()]
        spans, seen = [], set()
        for start, stop in zip(edges[:-1], edges[1:], strict=True):
            block = int(row[start])
            if block < 0:
                continue
            if block in seen:
                return f"a block (id {block}) of tokens that are not consecutive, which a causal sequence cannot split"
            seen.add(block)
            if stop - start > 1:
                spans.append((start, stop))
        rows.append(tuple(spans))
    return Blocks(tuple(rows), ids.shape[-1])


def _remaps_or(function: Callable) -> bool:
    """Whether an OR of masks sits under ``remap_positions_for_packed_sequence`` (its block ids then indexed by
    positions within documents)."""
    name = _name(function)
    if name == _REMAP:
        inner = _closure_value(function, "mask_function")
        return any(_name(leaf) == _OR for leaf in _pieces(inner))
    if name in _COMBINATORS or name == _ADDED:
        return any(
            _remaps_or(item)
            for cell in function.__closure__ or ()
            for item in (cell.cell_contents if isinstance(cell.cell_contents, tuple | list) else [cell.cell_contents])
            if callable(item)
        )
    return False


def check_mask_tensor(
    mask: torch.Tensor, tokens: torch.Tensor, bounds: tuple[int, ...], causal: bool, window: int | None
) -> str | None:
    """Whether a mask tensor a model built for this rank's shard says no more than ds_ring computes.

    Args:
        mask: ``[b or 1, 1 or heads, s/p, s/p]``, boolean (True: attend) or additive (0: attend).
        tokens: ``[s/p]``, the global position of each of this rank's tokens.
        bounds: the documents ``[0, ..., S]`` of the whole sequence.
        causal, window: what ds_ring will compute.

    Returns:
        ``None`` when, for every pair of this rank's tokens that are adjacent in the sequence's order (the
        frame the model built its mask in) and in one document, the mask allows exactly what ds_ring computes;
        else a description of the first difference. Reads the mask to the host (first call only).
    """
    allowed = mask if mask.dtype == torch.bool else mask == 0
    allowed = allowed.detach().to("cpu").reshape(-1, *allowed.shape[-2:])
    n = tokens.numel()
    if allowed.shape[-2:] != (n, n):
        return f"a mask of shape {tuple(mask.shape)} for {n} tokens"
    documents = torch.bucketize(tokens, torch.tensor(bounds[1:-1]), right=True)
    distance = tokens[:, None] - tokens[None, :]
    local = torch.arange(n)
    contiguous = (local[:, None] - local[None, :]) == distance  # one run of the layout: the model's frame agrees
    comparable = contiguous & (documents[:, None] == documents[None, :])
    expected = distance >= 0 if causal else torch.ones(n, n, dtype=torch.bool)
    if window is not None:
        expected &= distance < window if causal else distance.abs() < window
    differs = (allowed != expected) & comparable
    if bool(differs.any()):
        row, q, k = (int(i) for i in differs.nonzero()[0])
        return (
            f"a mask that {'allows' if bool(allowed[row, q, k]) else 'blocks'} position {int(tokens[q])} attending "
            f"to {int(tokens[k])}"
        )
    return None
