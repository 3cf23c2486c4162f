"""What holds a rank's memory at its peak: every tensor storage made during a step, by the op and module that made it.

:class:`TensorCensus` is a ``TorchDispatchMode``: while active it records each new storage of at least
``min_bytes`` that an op allocates, labelled with the module whose forward was running (``recompute:`` inside
a backward, as gradient checkpointing reruns it) or the autograd node computing a gradient, and forgets it when
the storage is freed. At every allocation it compares the live total with the peak so far and keeps the peak's
composition. It counts tensors only: parameters and buffers made before it started are not in it, and neither
is memory the allocator keeps after a free (glibc's heap on a CPU, the caching allocator on CUDA).

For diagnosis, not for steady state: every op pays a Python call.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["TensorCensus", "CensusPeak"]


@dataclass
class CensusPeak:
    """The live storages at the largest live total seen: ``bytes`` in all, ``by_label`` bytes per label."""

    bytes: int = 0
    by_label: dict[str, int] = field(default_factory=dict)

    def table(self, top: int = 12) -> list[tuple[str, float]]:
        """``[(label, MiB), ...]``: the ``top`` largest labels, largest first, then ``("other", MiB)``."""
        ranked = sorted(self.by_label.items(), key=lambda item: -item[1])
        rows = [(label, size / 2**20) for label, size in ranked[:top]]
        rest = sum(size for _, size in ranked[top:])
        return rows + ([("other", rest / 2**20)] if rest else [])


class TensorCensus(TorchDispatchMode):
    """Live tensor storages of ``min_bytes`` or more made while active, and the composition at their peak.

    Args:
        model: its ``named_modules()`` name the labels (``model.layers.0.self_attn``); ``None``: op names only.
        min_bytes: smaller storages are not counted (bytes).
    """

    def __init__(self, model: nn.Module | None = None, min_bytes: int = 1 << 16) -> None:
        super().__init__()
        self.min_bytes = min_bytes
        self.peak = CensusPeak()
        self._live: dict[int, tuple[StorageWeakRef, int, str]] = {}
        self._total = 0
        self._names = {id(m): name or "model" for name, m in model.named_modules()} if model is not None else {}
        self._stack: list[str] = []
        self._handles: list[Any] = []

    def __enter__(self) -> TensorCensus:
        if self._names:
            self._handles = [
                nn.modules.module.register_module_forward_pre_hook(self._enter_module),
                nn.modules.module.register_module_forward_hook(self._leave_module, always_call=True),
            ]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        super().__exit__(*exc)

    def _enter_module(self, module: nn.Module, args: Any) -> None:
        name = self._names.get(id(module))
        if name is not None:
            self._stack.append(name)

    def _leave_module(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._names.get(id(module)) is not None and self._stack:
            self._stack.pop()

    def _label(self, func: Any) -> str:
        node = torch._C._current_autograd_node()
        where = self._stack[-1] if self._stack else ""
        if node is not None:
            where = f"recompute:{where}" if where else f"grad:{node.name()}"
        op = func.overloadpacket.__name__
        return f"{where} {op}" if where else op

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        fresh = []
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
                storage = leaf.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
                known = self._live.get(key)
                if size >= self.min_bytes and (known is None or known[0].expired()):
                    fresh.append((key, StorageWeakRef(storage), size))
        if fresh:
            self._sweep()
            label = self._label(func)
            for key, ref, size in fresh:
                if key in self._live:
                    continue  # two outputs of one op on one storage
                self._live[key] = (ref, size, label)
                self._total += size
            if self._total > self.peak.bytes:
                by_label: Counter[str] = Counter()
                for _, size, where in self._live.values():
                    by_label[where] += size
                self.peak = CensusPeak(self._total, dict(by_label))
        return out

    def _sweep(self) -> None:
        for key in [k for k, (ref, _, _) in self._live.items() if ref.expired()]:
            self._total -= self._live.pop(key)[1]
