"""Count the tensor ops a piece of code dispatches (a :class:`TorchDispatchMode`): what a GPU launches, roughly."""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCount"]


class OpCount(TorchDispatchMode):
    """``with OpCount() as ops: ...`` then ``ops.total`` (every aten op dispatched) and ``ops.by_op``."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.by_op[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.by_op.values())
