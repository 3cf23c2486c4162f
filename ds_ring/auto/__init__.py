"""``strategy="auto"``: choose the strategy, layout, degrees and ring chunk by a cost model.

- :mod:`ds_ring.auto.model` — the cost and memory model (pure arithmetic, no torch.distributed):
  :func:`~ds_ring.auto.model.plan_options` lists every valid option with its predicted step time and
  memory per rank, best first.
- :mod:`ds_ring.auto.probe` — the link probe at start-up (a few small all-to-alls, a small matmul),
  cached per process group and agreed by every rank, so every rank decides alike.
- :mod:`ds_ring.auto.strategy` — the ``"auto"`` strategy, registered with the others.
- ``python -m ds_ring.auto`` — the choice, the alternatives and their predictions before any run.
"""

from ds_ring.auto.model import Link, Option, Problem, choose, plan_options

__all__ = ["Link", "Option", "Problem", "choose", "plan_options"]
