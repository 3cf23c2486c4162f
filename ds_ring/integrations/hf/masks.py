"""What a model's attention mask says, read from the mask function transformers composes, never discarded.

transformers builds every mask from an index function (``mask_function(batch, head, q, kv) -> bool``) composed
of known pieces (``causal_mask_function``, ``sliding_window_overlay(w)``, ``chunked_overlay(c)``, packing,
padding, ``and_masks`` / ``or_masks``) and hands it to the mask interface of the model's attention
implementation. ds_ring replaces that interface (:func:`mask_spec`): instead of a ``[b, 1, s, s]`` tensor the
attention receives a :class:`MaskSpec` — causal or not, and the window — read off the composition by walking the
function's closures (Python only: no tensor is made or read). A piece ds_ring cannot reproduce (a chunked or
bidirectional window, an ``or`` of masks such as image tokens attending bidirectionally, a function transformers
does not define) makes the spec *unsupported*, and the attention refuses it by name on its first call.

A model that builds a mask tensor itself and hands it to its attention (rather than through the interface) is
checked by :func:`check_mask_tensor` on the first call of each shape: the tensor must be what causal attention,
the window and the documents give on this rank's shard, else it is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MaskSpec", "mask_spec", "check_mask_tensor"]

# Pieces of transformers.masking_utils, by qualified name: what each one means for ds_ring.
_CAUSAL = "causal_mask_function"
_BIDIRECTIONAL = "bidirectional_mask_function"
_WINDOW = "sliding_window_overlay.<locals>.inner_mask"
_DOCUMENTS = "packed_sequence_mask_function.<locals>.inner_mask"  # ds_ring's documents give the same mask
_COMBINATORS = {"and_masks.<locals>.and_mask", "remap_positions_for_packed_sequence.<locals>.inner_mask"}
_ADDED = "add_offsets_to_mask_function.<locals>.inner_mask"
_UNSUPPORTED = {
    "or_masks.<locals>.or_mask": "an OR of masks (e.g. image tokens attending bidirectionally)",
    "chunked_overlay.<locals>.inner_mask": "chunked attention (attention only inside fixed chunks)",
    "sliding_window_bidirectional_overlay.<locals>.inner_mask": "a bidirectional sliding window",
    "blockwise_overlay.<locals>.inner_mask": "blockwise bidirectional attention",
    "padding_mask_function.<locals>.inner_mask": "padding",
}


@dataclass(frozen=True)
class MaskSpec:
    """A model's mask, as ds_ring computes it: ``causal`` and ``window`` (keys ``q - window < k ≤ q``; ``None``:
    no window). ``unsupported`` names a piece ds_ring cannot compute (then the attention refuses it)."""

    causal: bool
    window: int | None
    unsupported: str | None = None

    def __bool__(self) -> bool:  # a model testing ``if attention_mask:`` sees a mask
        return True

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle and friends probe dunders: not a use of the mask
            raise AttributeError(name)
        raise _builds_on_mask(f".{name}")

    def __getitem__(self, index: Any) -> Any:
        raise _builds_on_mask("[...]")

    def _operator(self, *_: Any) -> Any:
        raise _builds_on_mask("arithmetic")

    __add__ = __radd__ = __mul__ = __rmul__ = __and__ = __rand__ = __or__ = __ror__ = __sub__ = __rsub__ = _operator

    @classmethod
    def __torch_function__(cls, func: Any, _types: Any, _args: Any = (), _kwargs: Any = None) -> Any:
        # a torch function given the spec where it wants a mask tensor (Falcon's own F.scaled_dot_product_attention)
        raise _builds_on_mask(f"{getattr(func, '__name__', func)}(...)")


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
    causal, bidirectional, windows = False, False, []
    for piece in _pieces(mask_function):
        name = getattr(piece, "__qualname__", repr(piece))
        module = getattr(piece, "__module__", "")
        if name in _UNSUPPORTED:
            return MaskSpec(causal=True, window=None, unsupported=_UNSUPPORTED[name])
        if name == _CAUSAL:
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
    return MaskSpec(causal=causal, window=min(windows) if windows else None)


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
