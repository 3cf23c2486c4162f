"""A vision encoder's work divided over the sequence-parallel ranks: each rank encodes its frames, all get every row.

Under :mod:`~ds_ring.integrations.hf.vision` every rank runs the model's merge on the whole sequence, so by default
every rank would encode every image. For a Qwen-style vision encoder (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: ``forward(
pixel_values [patches, channels·patch], grid_thw [items, 3])``, each temporal frame of an item attended on its own)
:class:`FrameSplit` cuts the items into frames and gives each rank a contiguous run of about ``frames / p`` of them:
a forward pre-hook hands the encoder this rank's patch rows and their ``[frames, h, w]`` grid pieces, and a forward
hook replaces its output by every rank's rows, in the whole call's order, through one all-gather
(:class:`_GatherRows`). The encoder's activations on a rank are then its frames' (measured in
``docs/performance.md``).

Exact because the encoder treats frames independently: its attention's ``cu_seqlens`` cut every frame (a window
attention's windows lie inside a frame), its rotary and learned position tables repeat over frames, and the patch
merger merges within a frame. The gradient contract holds: the all-gather's backward sums every rank's gradient of the
gathered rows (each rank's is its tokens' share) and hands each rank its own rows' sum, so each rank's encoder
gradient is its frames' whole-model gradient, and the group's sum is the whole model's.

Fewer frames than ranks: every rank encodes every frame (as without the split; still exact).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ds_ring.integrations.internal import all_gather, all_reduce, group_members

__all__ = ["FrameSplit", "frame_encoders", "frame_plan"]


def frame_encoders(modules: Sequence[nn.Module]) -> list[nn.Module]:
    """The Qwen-style vision encoders among ``modules``: a ``spatial_merge_size`` and a ``forward(<patch rows>,
    grid_thw, ...)`` (the first input ``hidden_states`` or, Muse's, ``pixel_values``); the outermost only (an encoder
    inside another is not split twice). A module that merges frames (``temporal_merge_size`` > 1: ERNIE 4.5-VL's
    resampler, after its encoder) does not treat them independently and is not one."""
    found = [
        m
        for m in modules
        if hasattr(m, "spatial_merge_size")
        and "grid_thw" in inspect.signature(m.forward).parameters
        and int(getattr(m, "temporal_merge_size", 1) or 1) == 1
    ]
    inner = {id(sub) for m in found for sub in m.modules() if sub is not m}
    return [m for m in found if id(m) not in inner]


@dataclass(frozen=True)
class Plan:
    """One encoder call divided: this rank's patch rows ``[start, end)`` and grid pieces, and each rank's patch
    count (``patches``), for ``merge`` = spatial merge size²."""

    start: int
    end: int
    grid: torch.Tensor
    patches: tuple[int, ...]
    merge: int


def frame_plan(grid_thw: torch.Tensor, rank: int, world: int, merge: int) -> Plan | None:
    """This rank's frames of a call with ``grid_thw [items, 3]``: frames ``[r·F/p, (r+1)·F/p)`` of the ``F``
    frames in item order (``None`` when ``F < p``)."""
    grids = [tuple(int(v) for v in row) for row in grid_thw.tolist()]
    frames = sum(t for t, _, _ in grids)
    if frames < world:
        return None
    bounds = [r * frames // world for r in range(world + 1)]
    patches, pieces, start, end = [], [], 0, 0
    for r in range(world):
        first, last, frame, row, count = bounds[r], bounds[r + 1], 0, 0, 0
        for t, h, w in grids:
            lo, hi = max(first, frame), min(last, frame + t)
            if lo < hi:
                if r == rank:
                    pieces.append([hi - lo, h, w])
                    start = start if count else row + (lo - frame) * h * w
                count += (hi - lo) * h * w
            frame, row = frame + t, row + t * h * w
        patches.append(count)
        if r == rank:
            end = start + count
    grid = torch.tensor(pieces, dtype=grid_thw.dtype, device=grid_thw.device)
    return Plan(start, end, grid, tuple(patches), merge)


class _GatherRows(torch.autograd.Function):
    """Every rank's rows of several tensors, concatenated in rank order (one all-gather); backward: the group's sum
    of the gradients of the gathered rows, this rank's rows of it."""

    @staticmethod
    def forward(ctx, rows, group, timeout_s, *tensors):  # noqa: ANN001, ANN205
        ranks = group_members(group)
        me = ranks.index(torch.distributed.get_rank())
        widths = [int(torch.tensor(t.shape[1:]).prod()) for t in tensors]
        per_rank = [sum(w * r[i] for w, r in zip(widths, rows, strict=True)) for i in range(len(ranks))]
        flat = torch.cat([t.reshape(-1) for t in tensors])
        parts = all_gather(flat, ranks, group=group, numels=per_rank, op="vision_rows", timeout_s=timeout_s)
        gathered = [[] for _ in tensors]
        for i, part in enumerate(parts):
            for k, piece in enumerate(part.split([w * r[i] for w, r in zip(widths, rows, strict=True)])):
                gathered[k].append(piece.view(-1, *tensors[k].shape[1:]))
        ctx.rows, ctx.me, ctx.group, ctx.timeout_s = rows, me, group, timeout_s
        return tuple(torch.cat(g) for g in gathered)

    @staticmethod
    def backward(ctx, *grads):  # noqa: ANN001, ANN205
        own = []
        for k, grad in enumerate(grads):
            summed = all_reduce(grad.contiguous(), group=ctx.group, op="vision_rows_backward", timeout_s=ctx.timeout_s)
            start = sum(ctx.rows[k][: ctx.me])
            own.append(summed[start : start + ctx.rows[k][ctx.me]])
        return (None, None, None, *own)


class FrameSplit:
    """Hooks dividing one Qwen-style vision encoder's calls over the sequence-parallel ranks (module docstring).

    ``disable_in_eval``: in eval mode the encoder runs whole, undivided (each rank then evaluates its own samples, as
    the registration's ``disable_in_eval`` runs the whole model: divided, the ranks would exchange rows of different
    images)."""

    def __init__(self, encoder: nn.Module, topology: Any, *, disable_in_eval: bool = False) -> None:
        self.encoder = encoder
        self.topology = topology
        self.disable_in_eval = disable_in_eval
        self.merge = int(encoder.spatial_merge_size) ** 2
        self.pixels = next(iter(inspect.signature(encoder.forward).parameters))
        """The name of ``forward``'s first parameter, the patches (``hidden_states``; MiniMax-M3-VL's and Muse's
        ``pixel_values``, which their models pass by name)."""
        self._plans: list[tuple[Plan | None, tuple, dict[str, Any]]] = []  # with the call's own inputs
        self.whole = False
        """Encode every call whole from now on: a call's output was no model output with named fields, or had a
        field of neither a row per patch nor per merged patch (MiniMax-M3-VL's ``[1, patches, hidden]`` and its
        ``pooler_output``, its first patch's row), which no gather of rows makes the whole call's; found alike on
        every rank before any exchange, and that call encoded again whole."""
        merge_size = getattr(encoder, "merge_size", None)  # Muse's pixel shuffle after a spatial_merge_size of 1
        self.merges = tuple(sorted({self.merge} | ({int(merge_size) ** 2} if isinstance(merge_size, int) else set())))
        """Patches per output row the encoder's merges make: its ``spatial_merge_size``² and ``merge_size``²."""
        self._handles = [
            encoder.register_forward_pre_hook(self._divide, with_kwargs=True),
            encoder.register_forward_hook(self._gather, with_kwargs=True, always_call=True),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _divide(self, _module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        kwargs = dict(kwargs)
        pixels = args[0] if args else kwargs.pop(self.pixels)
        grid = args[1] if len(args) > 1 else kwargs.pop("grid_thw")
        group = self.topology.sequence_parallel_group
        world = self.topology.get_sequence_parallel_world_size()
        divided = world > 1 and not self.whole and not (self.disable_in_eval and not self.encoder.training)
        plan = frame_plan(grid, self.topology.get_sequence_parallel_rank(), world, self.merge) if divided else None
        self._plans.append((plan, (pixels, grid, *args[2:]), kwargs))
        if plan is None or group is None:
            return (pixels, grid, *args[2:]), kwargs
        return (pixels[plan.start : plan.end], plan.grid, *args[2:]), kwargs

    def _gather(self, _module: nn.Module, _args: tuple, _kwargs: dict[str, Any], output: Any) -> Any:
        plan, whole_args, whole_kwargs = self._plans.pop() if self._plans else (None, (), {})
        if plan is None or output is None:
            return output
        if not hasattr(output, "items"):  # no named fields to gather: this call, and every later, whole
            self.whole = True
            return self.encoder.forward(*whole_args, **whole_kwargs)
        mine = plan.end - plan.start
        fields: list[tuple[str, int | None]] = []  # (field, index in a list field or None)
        tensors, rows = [], []
        for name, value in output.items():
            for index, tensor in [(None, value)] if isinstance(value, torch.Tensor) else enumerate(value or ()):
                if not isinstance(tensor, torch.Tensor):
                    continue
                merge = next((m for m in (1, *self.merges) if tensor.shape[0] * m == mine), None)
                if merge is None:  # every rank finds it alike (before any exchange): this call, and every later, whole
                    self.whole = True
                    return self.encoder.forward(*whole_args, **whole_kwargs)
                rows.append(tuple(p // merge for p in plan.patches))
                fields.append((name, index))
                tensors.append(tensor)
        if not tensors:
            return output
        gathered = _GatherRows.apply(tuple(rows), self.topology.sequence_parallel_group, self.topology.timeout_s,
                                     *tensors)  # fmt: skip
        for (name, index), tensor in zip(fields, gathered, strict=True):
            if index is None:
                output[name] = tensor
            else:
                listed = list(output[name])
                listed[index] = tensor
                output[name] = listed
        return output
