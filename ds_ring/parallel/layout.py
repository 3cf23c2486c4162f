"""Where every rank sits in a ``data_parallel × ring × ulysses`` grid: pure arithmetic, no process groups.

With degrees ``D`` (data parallel), ``U`` (ulysses) and ``R`` (ring),

    rank = d·(U·R) + r·U + u

so a sequence-parallel group (``U·R`` ranks, sequence-parallel rank ``r·U + u``) is made of
consecutive ranks, the ulysses dimension is innermost (it carries all-to-alls: keep it inside a
node), the ring next and data parallel outermost. The sequence is cut into shards in
sequence-parallel rank order (:mod:`ds_ring.parallel.order`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ROLES", "DEGREE_KEYS", "Partition", "RankLayout", "rank_layout", "read_key"]

ROLES = (
    "sequence_parallel",
    "ulysses",
    "ring",
    "data_parallel",
    "sequence_data_parallel",
    "model_parallel",
)
"""The process groups a topology holds, in the order they are created (the same on every rank)."""

Partition = tuple[tuple[int, ...], ...]
DEGREE_KEYS = ("ulysses_degree", "ring_degree", "sequence_parallel_size")
"""The keys of a ``ring_attention`` section that set the degrees."""


def _check_degree(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class RankLayout:
    """Where every rank sits in the ``data_parallel × ring × ulysses`` grid (no process groups).

    Every group of a role is a tuple of ranks in increasing order, which is also its group-rank
    order; a role's groups partition ``range(world_size)``.
    """

    data_parallel: int
    ulysses: int
    ring: int

    def __post_init__(self) -> None:
        for name in ("data_parallel", "ulysses", "ring"):
            _check_degree(name, getattr(self, name))

    @property
    def sequence_parallel(self) -> int:
        """Ranks that share one sequence: ``ulysses × ring``."""
        return self.ulysses * self.ring

    @property
    def world_size(self) -> int:
        return self.data_parallel * self.sequence_parallel

    def rank(self, d: int, r: int, u: int) -> int:
        """The rank at data-parallel index ``d``, ring index ``r``, ulysses index ``u``."""
        return d * self.sequence_parallel + r * self.ulysses + u

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(d, r, u)`` of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a layout of {self.world_size} ranks")
        d, sp = divmod(rank, self.sequence_parallel)
        r, u = divmod(sp, self.ulysses)
        return d, r, u

    def sequence_parallel_rank(self, rank: int) -> int:
        """Position of ``rank``'s shard in its sequence: ``r·U + u``."""
        return rank % self.sequence_parallel

    def groups(self, role: str) -> Partition:
        """Every group of ``role`` (one of :data:`ROLES`), each a tuple of increasing ranks."""
        D, R, U = self.data_parallel, self.ring, self.ulysses
        if role == "sequence_parallel":
            return tuple(tuple(self.rank(d, r, u) for r in range(R) for u in range(U)) for d in range(D))
        if role == "ulysses":
            return tuple(tuple(self.rank(d, r, u) for u in range(U)) for d in range(D) for r in range(R))
        if role == "ring":
            return tuple(tuple(self.rank(d, r, u) for r in range(R)) for d in range(D) for u in range(U))
        if role == "data_parallel":
            return tuple(tuple(self.rank(d, r, u) for d in range(D)) for r in range(R) for u in range(U))
        if role == "sequence_data_parallel":
            return (tuple(range(self.world_size)),)
        if role == "model_parallel":  # no tensor or pipeline parallelism: every rank alone
            return tuple((rank,) for rank in range(self.world_size))
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")

    def group_of(self, role: str, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s group of ``role``."""
        return next(g for g in self.groups(role) if rank in g)

    @classmethod
    def from_config(cls, section: Any, world_size: int) -> RankLayout:
        """Degrees from a ``ring_attention`` config section (an object or a mapping).

        Reads ``ulysses_degree``, ``ring_degree`` and ``sequence_parallel_size`` (each may be absent
        or ``None``): ``ulysses`` defaults to 1 (or ``sequence_parallel_size / ring``), the
        sequence-parallel size to ``ulysses × ring`` (or the whole world when ``ring`` is absent too),
        ``ring`` to ``sequence_parallel_size / ulysses``. Data parallel = ``world_size / (ulysses × ring)``.

        Raises:
            ValueError: inconsistent degrees, naming every factor.
        """
        _check_degree("world_size", world_size)
        ulysses, ring, sp = (read_key(section, k) for k in DEGREE_KEYS)
        for name, value in (("ulysses_degree", ulysses), ("ring_degree", ring), ("sequence_parallel_size", sp)):
            if value is not None:
                _check_degree(name, value)
        if ulysses is None:
            ulysses = sp // ring if sp is not None and ring is not None and sp % ring == 0 else 1
        if sp is None:
            sp = ulysses * ring if ring is not None else world_size
        if ring is None:
            if sp % ulysses:
                raise ValueError(
                    f"sequence_parallel_size {sp} is not a multiple of ulysses_degree {ulysses}; set ring_degree, or "
                    f"a ulysses_degree that divides {sp}"
                )
            ring = sp // ulysses
        if ulysses * ring != sp:
            raise ValueError(
                f"ulysses_degree {ulysses} × ring_degree {ring} = {ulysses * ring} ≠ sequence_parallel_size {sp}; "
                f"set the degrees so that their product is the sequence-parallel size"
            )
        if world_size % sp:
            raise ValueError(
                f"ulysses_degree {ulysses} × ring_degree {ring} = {sp} does not divide the world size {world_size}, "
                f"so data parallel = world size / (ulysses × ring) is not a whole number; choose degrees whose "
                f"product divides {world_size}"
            )
        return rank_layout(world_size, data_parallel=world_size // sp, ulysses=ulysses, ring=ring)


def read_key(section: Any, key: str) -> Any:
    """``section[key]`` of a mapping, ``section.key`` of an object; ``None`` when absent."""
    return section.get(key) if isinstance(section, Mapping) else getattr(section, key, None)


def rank_layout(world_size: int, *, data_parallel: int = 1, ulysses: int = 1, ring: int = 1) -> RankLayout:
    """The layout of ``world_size`` ranks; the one place where the degrees are checked.

    Raises:
        ValueError: a degree is not a positive integer, or ``data_parallel × ulysses × ring``
            differs from ``world_size`` (the message names every factor and a fix).
    """
    layout = RankLayout(data_parallel, ulysses, ring)
    if layout.world_size != world_size:
        sp = ulysses * ring
        fix = (
            f"with ulysses {ulysses} × ring {ring} use data_parallel {world_size // sp}"
            if world_size % sp == 0
            else f"ulysses × ring = {sp} must divide the world size"
        )
        raise ValueError(
            f"data_parallel {data_parallel} × ulysses {ulysses} × ring {ring} = {layout.world_size} ≠ world size "
            f"{world_size}: the degrees must multiply to the number of ranks; {fix}"
        )
    return layout
