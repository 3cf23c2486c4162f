"""Bidirectional spans inside a causal sequence (vision-language models: image tokens, prefix-LM), as index math.

A *span* ``[a, b)`` is a run of tokens that see each other fully inside an otherwise causal sequence (Gemma 3's
image tokens; PaliGemma's image + prompt prefix, the span ``[0, P)``). The mask is ``causal OR same span``
(docs/design.md §Bidirectional spans). Since a query ``i`` of span ``[a, b)`` sees every key ``j <= i`` and every
key of ``[a, b)``, its keys are exactly ``j < b``: a causal mask whose query ``i`` *reaches* position
``hi(i) = b - 1`` instead of ``i``. ``hi`` never decreases along the sequence, so a (query run, key run) pair cuts
into a few rectangles and causal diagonals — blocks every block kernel computes — and a key run entirely in a query
run's future is needed only by the rows of the one span that reaches into it. With a causal sliding window (Gemma
3's sliding layers) the mask is ``(causal OR same span) AND window``: bands for causal rows and for the keys before a
span, the span's own keys in full.

Spans are given over the *global* sequence as sorted, disjoint ``(start, stop)`` pairs, each inside one document.
Only :func:`spans_from_ids` reads a tensor (to the host).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from itertools import pairwise

import torch

__all__ = [
    "BAND",
    "DIAGONAL",
    "FULL",
    "Spans",
    "check_spans",
    "check_span_options",
    "prefix_spans",
    "reach",
    "resolve_spans",
    "span_blocks",
    "spans_from_ids",
    "spans_within",
]

Spans = tuple[tuple[int, int], ...]
"""Bidirectional spans ``((a0, b0), (a1, b1), ...)``: half-open, sorted, disjoint, over the global sequence."""


def spans_from_ids(ids: torch.Tensor | Sequence[int]) -> Spans:
    """The spans of per-token span ids ``[seq]`` (or ``[1, seq]``): tokens with the same nonzero id form one span,
    and must be consecutive; 0 marks a causal token. Reads a tensor to the host."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(
                f"bidirectional_spans as span ids must be a 1-D integer tensor [seq] (0: causal token, equal nonzero "
                f"ids: one span), got shape {tuple(ids.shape)} dtype {ids.dtype}; or pass (start, stop) pairs"
            )
        ids = ids.tolist()
    spans: list[tuple[int, int]] = []
    seen: set[int] = set()
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[start]:
            span_id = ids[start]
            if span_id != 0:
                if span_id in seen:
                    raise ValueError(
                        f"bidirectional_spans: span id {span_id} marks tokens that are not consecutive (again at "
                        f"position {start}); a span is one run of tokens, give each run its own id"
                    )
                seen.add(span_id)
                spans.append((start, i))
            start = i
    return tuple(spans)


def prefix_spans(prefix_lengths: int | Sequence[int], bounds: Sequence[int]) -> Spans:
    """Prefix-LM: the span ``[c_j, c_j + P_j)`` of every document ``[c_j, c_{j+1})`` of ``bounds`` (``P_j``: one
    length per document, or one int for all); a prefix of 0 or 1 token is left causal (it changes nothing)."""
    documents = list(pairwise(bounds))
    lengths = [prefix_lengths] * len(documents) if isinstance(prefix_lengths, int) else list(prefix_lengths)
    if len(lengths) != len(documents) or any(not isinstance(p, int) or isinstance(p, bool) for p in lengths):
        raise ValueError(
            f"prefix_lengths must be one integer, or one integer per document ({len(documents)} documents), got "
            f"{prefix_lengths!r}"
        )
    spans = []
    for (start, stop), length in zip(documents, lengths, strict=True):
        if not 0 <= length <= stop - start:
            raise ValueError(
                f"prefix_lengths: a prefix of {length} tokens does not fit the document [{start}, {stop}) "
                f"({stop - start} tokens); give 0 <= prefix <= the document's length"
            )
        if length > 1:
            spans.append((start, start + length))
    return tuple(spans)


def check_spans(spans: Sequence[Sequence[int]], bounds: Sequence[int]) -> Spans:
    """``spans`` as :data:`Spans` once valid over documents ``bounds`` ``[0, ..., seq]``: integer pairs ``0 <= a < b
    <= seq``, sorted, disjoint, each inside one document; ``ValueError`` naming the span and the fix otherwise."""
    seq = bounds[-1]
    checked: list[tuple[int, int]] = []
    for span in spans:
        pair = tuple(span) if isinstance(span, Sequence) else ()
        if len(pair) != 2 or any(not isinstance(x, int) or isinstance(x, bool) for x in pair):
            raise ValueError(
                f"bidirectional_spans must be (start, stop) integer pairs over the global sequence, or per-token span "
                f"ids; got {span!r}"
            )
        a, b = pair
        if not 0 <= a < b <= seq:
            raise ValueError(f"bidirectional_spans: span ({a}, {b}) is not inside the sequence [0, {seq}); give 0 <= "
                             f"start < stop <= {seq}")  # fmt: skip
        if checked and a < checked[-1][1]:
            raise ValueError(
                f"bidirectional_spans must be sorted and disjoint, got ({a}, {b}) after {checked[-1]}; merge or "
                f"order them"
            )
        document = bisect.bisect_right(bounds, a) - 1
        if b > bounds[document + 1]:
            raise ValueError(
                f"bidirectional_spans: span ({a}, {b}) crosses the end of its document [{bounds[document]}, "
                f"{bounds[document + 1]}) (cu_seqlens); a span lies inside one document"
            )
        checked.append((a, b))
    return tuple(checked)


def reach(spans: Spans, position: int) -> int:
    """The last key position query ``position`` sees: the end of its span less one, else itself."""
    i = bisect.bisect_right(spans, (position, float("inf"))) - 1
    if i >= 0 and spans[i][0] <= position < spans[i][1]:
        return spans[i][1] - 1
    return position


def spans_within(spans: Spans, start: int, stop: int) -> Spans:
    """The spans inside ``[start, stop)`` (a document or a run of it), relative to ``start``."""
    i = bisect.bisect_left(spans, (start, start))
    found = []
    while i < len(spans) and spans[i][0] < stop:
        a, b = spans[i]
        found.append((max(a, start) - start, min(b, stop) - start))
        i += 1
    return tuple(found)


def _row_groups(start: int, stop: int, spans: Spans) -> Iterator[tuple[int, int, int | None]]:
    """Query rows ``[start, stop)`` cut at span edges: ``(c, d, end)``, ``end`` the span's stop (its rows see keys
    ``< end``) or ``None`` for causal rows."""
    at = start
    i = max(0, bisect.bisect_right(spans, (start, float("inf"))) - 1)
    while at < stop:
        while i < len(spans) and spans[i][1] <= at:
            i += 1
        if i < len(spans) and spans[i][0] <= at:
            d = min(stop, spans[i][1])
            yield at, d, spans[i][1]
        else:
            d = min(stop, spans[i][0]) if i < len(spans) else stop
            yield at, d, None
        at = d


FULL, DIAGONAL, BAND = "full", "diagonal", "band"
"""How a block of :func:`span_blocks` is computed: every pair, a causal block (rows and keys from one position), or
the causal sliding window's band (queries ``(q0 + qpos) - (k0 + kpos)`` positions ahead of the keys)."""


def span_blocks(
    qpos: int, m: int, kpos: int, n: int, spans: Spans, window: int | None = None
) -> list[tuple[int, int, int, int, str]]:
    """The blocks of ``m`` queries at positions ``[qpos, qpos + m)`` over ``n`` keys at ``[kpos, kpos + n)`` under
    ``causal OR same span`` (both runs in one document), and with a ``window`` under ``(causal OR same span) AND
    window`` (Gemma 3's sliding layers; every span at most ``window`` long): ``(q0, q1, k0, k1, how)`` offsets into
    the runs, ``how`` one of :data:`FULL`, :data:`DIAGONAL`, :data:`BAND`. They cover every visible pair exactly
    once."""
    kend = kpos + n
    blocks = []
    for c, d, end in _row_groups(qpos, qpos + m, spans):
        if end is not None:  # span rows see every key before the span's end (with a window: from i - window + 1)
            first = kpos
            if window is not None:  # the span's keys in full (all within the window), the keys before it by band
                first = max(kpos, min(kend, _span_start(spans, c)))
                if first > kpos:
                    blocks.append((c - qpos, d - qpos, 0, first - kpos, BAND))
            k1 = min(kend, end)
            if k1 > first:
                blocks.append((c - qpos, d - qpos, first - kpos, k1 - kpos, FULL))
            continue
        if window is not None:  # causal rows: the window's band over the whole key run
            blocks.append((c - qpos, d - qpos, 0, n, BAND))
            continue
        k1 = min(kend, c)  # causal rows: keys before them in full, the diagonal, nothing after
        if k1 > kpos:
            blocks.append((c - qpos, d - qpos, 0, k1 - kpos, FULL))
        s, e = max(kpos, c), min(kend, d)
        if s < e:
            blocks.append((s - qpos, e - qpos, s - kpos, e - kpos, DIAGONAL))
            if e < d:
                blocks.append((e - qpos, d - qpos, s - kpos, e - kpos, FULL))
    return blocks


def _span_start(spans: Spans, position: int) -> int:
    """The first position of the span holding ``position``."""
    return spans[bisect.bisect_right(spans, (position, float("inf"))) - 1][0]


def resolve_spans(
    bidirectional_spans: torch.Tensor | Sequence[Sequence[int]] | Sequence[int] | None,
    prefix_lengths: int | Sequence[int] | None,
    bounds: Sequence[int],
) -> Spans | None:
    """The checked spans of a call over documents ``bounds`` ``[0, ..., seq]`` (``None``: none, plain causal).

    ``bidirectional_spans``: ``(start, stop)`` pairs, or per-token span ids ``[seq]`` (a tensor, read to the host,
    or a list of ints; :func:`spans_from_ids`). ``prefix_lengths``: prefix-LM (:func:`prefix_spans`).
    """
    if bidirectional_spans is None and prefix_lengths is None:
        return None
    if bidirectional_spans is not None and prefix_lengths is not None:
        raise ValueError(
            "give bidirectional_spans or prefix_lengths, not both; a prefix is the span (start, start + P) of its "
            "document, so add it to bidirectional_spans"
        )
    if prefix_lengths is not None:
        spans: Sequence[Sequence[int]] = prefix_spans(prefix_lengths, bounds)
    elif isinstance(bidirectional_spans, torch.Tensor) or (
        len(bidirectional_spans) and all(isinstance(x, int) for x in bidirectional_spans)
    ):
        ids = bidirectional_spans
        if len(ids if not isinstance(ids, torch.Tensor) else ids.reshape(-1)) != bounds[-1]:
            raise ValueError(
                f"bidirectional_spans as span ids must hold one id per token of the global sequence ({bounds[-1]}), "
                f"got {tuple(ids.shape) if isinstance(ids, torch.Tensor) else len(ids)}"
            )
        spans = spans_from_ids(ids)
    else:
        spans = bidirectional_spans
    return check_spans(spans, bounds) or None


def check_span_options(spans: object, causal: bool, window: int | None, segment_lengths: Sequence[int] | None) -> None:
    """``ValueError`` for spans (any form; ``None``: none) the kernels do not combine: without ``causal`` (every key
    is visible already), longer than a sliding ``window``, or with LongNet branches (dense attention only)."""
    if spans is None:
        return
    if not causal:
        raise ValueError(
            "bidirectional_spans / prefix_lengths make spans bidirectional inside a causal sequence, but causal=False "
            "(every token sees every other already); pass causal=True, or drop the spans"
        )
    if window is not None and isinstance(spans, tuple) and all(isinstance(x, tuple) for x in spans):  # resolved
        long = [(a, b) for a, b in spans if b - a > window]
        if long:
            raise ValueError(
                f"bidirectional span {long[0]} is {long[0][1] - long[0][0]} tokens long, longer than window={window}: "
                f"ds_ring computes (causal OR same span) AND window for spans of at most the window; use a window of "
                f"at least {max(b - a for a, b in long)} or window=None for this layer"
            )
    if segment_lengths is not None:
        raise ValueError(
            f"bidirectional_spans / prefix_lengths work with dense attention only, got segment_lengths="
            f"{list(segment_lengths)}; remove segment_lengths/dilation_rates"
        )
