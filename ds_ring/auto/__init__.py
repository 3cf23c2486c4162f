"""``strategy="auto"``: choose the strategy, layout, degrees and ring chunk by a cost model.

- :mod:`ds_ring.auto.model` — the cost and memory model (pure arithmetic, no torch.distributed):
  :func:`~ds_ring.auto.model.plan_options` lists every valid option with its predicted step time and
  memory per rank, best first.
- :mod:`ds_ring.auto.probe` — the link probe at start-up (a few small all-to-alls, a small matmul),
  cached per process group and agreed by every rank, so every rank decides alike.
- :mod:`ds_ring.auto.strategy` — the ``"auto"`` strategy, registered here (importing this package), after the
  built-in ones: ``auto`` sits above :mod:`ds_ring.strategies` (it ranks what every registered strategy offers),
  which never imports it.
- ``python -m ds_ring.auto`` — the choice, the alternatives and their predictions before any run.
"""

from ds_ring.auto.model import Link, Option, Problem, choose, plan_options
from ds_ring.auto.strategy import Auto
from ds_ring.strategies import register_strategy

register_strategy(Auto())

__all__ = ["Auto", "Link", "Option", "Problem", "choose", "plan_options"]
