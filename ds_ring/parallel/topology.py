"""Process groups of sequence-parallel training: data × ring × ulysses, and DeepSpeed's ``mpu``.

A :class:`Topology` is built once, after ``torch.distributed.init_process_group``, and passed
explicitly to whatever needs a group (attention modules, ``deepspeed.initialize(mpu=...)``);
there is no module-level singleton.

Rank layout (:class:`RankLayout`, pure arithmetic): with degrees ``D`` (data parallel),
``U`` (ulysses) and ``R`` (ring),

    rank = d·(U·R) + r·U + u

so a sequence-parallel group (``U·R`` ranks, sequence-parallel rank ``r·U + u``) is made of
consecutive ranks, the ulysses dimension is innermost (it carries all-to-alls: keep it inside a
node), the ring next and data parallel outermost. The sequence is cut into contiguous shards in
sequence-parallel rank order.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ds_ring.comm.agree import agree
from ds_ring.comm.backends import device_backend
from ds_ring.comm.collectives import all_reduce
from ds_ring.comm.groups import takes_cpu
from ds_ring.comm.hosts import gather_hosts
from ds_ring.comm.wait import process_group_timeout_s, resolve_timeout
from ds_ring.placement import check_placement

__all__ = ["RankLayout", "rank_layout", "Topology", "ROLES", "sequence_group", "control_world", "needs_control_twins",
           "nccl_device"]

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
_SAME_DEGREES = (
    "build the Topology with the same degrees on every rank (the same ds_config and launch arguments on every node)"
)


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
        ulysses, ring, sp = (_read(section, k) for k in DEGREE_KEYS)
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


def _read(section: Any, key: str) -> Any:
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


_world_twins: weakref.WeakKeyDictionary[ProcessGroup, ProcessGroup] = weakref.WeakKeyDictionary()


def needs_control_twins(group: ProcessGroup | None = None) -> bool:
    """Whether groups made from ``group``'s default backend need a gloo twin for control traffic (they do
    when it takes no CPU tensors: plain NCCL). The same on every rank."""
    return not takes_cpu(group)


def control_world(group: ProcessGroup | None = None, timeout_s: float | None = None) -> ProcessGroup | None:
    """``group`` (``None``: the world) when its backend takes CPU tensors, else a gloo group of the same
    ranks, made once per group with the timeout :func:`~ds_ring.comm.wait.process_group_timeout_s` gives
    ``timeout_s`` (``None``: 300 s). Collective on its first call: every rank calls it at the same point."""
    if not dist.is_initialized() or not needs_control_twins(group):
        return group
    world = dist.group.WORLD if group is None else group
    twin = _world_twins.get(world)
    if twin is None:
        timeout = _group_timeout(resolve_timeout(timeout_s))
        twin = _world_twins[world] = dist.new_group(dist.get_process_group_ranks(world), backend="gloo",
                                                    timeout=timeout)  # fmt: skip
    return twin


def _group_timeout(timeout_s: float) -> timedelta:
    """What every group made here gets (``new_group`` without ``timeout`` takes the backend's default, 600 s
    for NCCL and 1,800 s for gloo, whatever ds_ring's bound): twice ``timeout_s``."""
    return timedelta(seconds=process_group_timeout_s(timeout_s))


def nccl_device(world: ProcessGroup | None = None) -> torch.device | None:
    """The CUDA device this rank's NCCL groups are bound to: the current one when ``world``'s backend moves
    CUDA tensors with NCCL (``"nccl"``, ``"cpu:gloo,cuda:nccl"``) and CUDA is available, else ``None``."""
    if device_backend(dist.get_backend(world), "cuda") != "nccl" or not torch.cuda.is_available():
        return None
    return torch.device("cuda", torch.cuda.current_device())


def _create_groups(
    layout: RankLayout, rank: int, world: ProcessGroup, control: ProcessGroup | None, twins: bool, timeout_s: float
) -> tuple[dict[str, ProcessGroup], dict[int, ProcessGroup | None]]:
    """This rank's group of every role, and the control group of each (by ``id``); every rank runs the same
    ``new_group`` calls in the same order, each with twice ``timeout_s`` as its timeout.

    A rank set that several roles share (e.g. sequence parallel = ulysses when ``ring == 1``) gets
    one process group; the set of all ranks is ``world`` itself (its control group: ``control``). With
    ``twins`` every other set also gets a gloo group, for control traffic.

    On NCCL (:func:`nccl_device`) each group is made with ``device_id``, so NCCL connects its communicator
    at creation, and then warmed up by one 1-element all-reduce, in creation order (the same on every
    rank, so no two ranks wait on each other's groups in opposite orders): its communicator never comes
    from a first batched point-to-point that might leave a member out (a packed batch, odd segments).
    """
    timeout, device = _group_timeout(timeout_s), nccl_device(world)
    bound = {} if device is None or getattr(dist.group.WORLD, "bound_device_id", None) else {"device_id": device}
    made: dict[tuple[int, ...], tuple[ProcessGroup, ProcessGroup | None]] = {}
    mine: dict[str, ProcessGroup] = {}
    controls: dict[int, ProcessGroup | None] = {id(world): control}
    warm: list[ProcessGroup] = []
    for role in ROLES:
        for ranks in layout.groups(role):
            if ranks not in made:
                if len(ranks) == layout.world_size:
                    made[ranks] = (world, control)
                else:
                    group = dist.new_group(list(ranks), timeout=timeout, **bound)
                    twin = dist.new_group(list(ranks), backend="gloo", timeout=timeout) if twins else group
                    made[ranks] = (group, twin)
                    if device is not None and rank in ranks and len(ranks) > 1:
                        warm.append(group)
            if rank in ranks:
                mine[role] = made[ranks][0]
                controls[id(made[ranks][0])] = made[ranks][1]
    for group in warm:
        all_reduce(torch.zeros(1, device=device), group=group, op="Topology warm-up", timeout_s=timeout_s)
    return mine, controls


@dataclass(frozen=True, eq=False, init=False)
class Topology:
    """Every process group of ``data_parallel × ulysses × ring`` sequence-parallel training.

    ``Topology(data_parallel=1, ulysses=1, ring=1, group=None, *, timeout_s=None)``, after
    ``torch.distributed.init_process_group``. Every process of the job must construct it with the
    same degrees, in the same order relative to other group creations (``torch.distributed.new_group``
    is collective over the whole job). ``group`` is the group whose ranks the topology divides; it
    must span every process (default: the world). The ranks first agree on the degrees (one small
    all-gather, :func:`ds_ring.comm.agree`, bounded by ``timeout_s``): degrees that differ raise a
    ``ValueError`` on every rank naming each rank's values. Then the degrees are checked, before any
    group is created. ``timeout_s`` (``None``: 300 s, :data:`ds_ring.comm.DEFAULT_TIMEOUT_S`) then
    bounds every wait of attention over this topology that names no timeout of its own; every group made
    here has twice it as its process-group timeout (the backend's watchdog stays the backstop). The ranks then
    exchange their hosts (:mod:`ds_ring.comm.hosts`, named in communication errors from then on) and
    check that no Ulysses group spans several hosts (:func:`ds_ring.placement.check_placement`):
    ``ulysses_across_hosts`` ``"warn"`` (a :class:`~ds_ring.placement.PlacementWarning` naming the ranks and
    hosts), ``"error"`` (a ``ValueError`` on every rank) or ``"allow"``.

    It is DeepSpeed's ``mpu``: pass it as ``deepspeed.initialize(..., mpu=topology)``. ZeRO then
    reduces gradients over :attr:`sequence_data_parallel_group` (all ``D·U·R`` ranks) and divides by
    its size / sequence-parallel size = ``D`` (ZeRO-3's reduce-scatter path, DeepSpeed's default,
    divides by all ``D·U·R``: see :mod:`ds_ring.loss`), ZeRO-3 partitions parameters over all ranks
    (:meth:`get_data_parallel_group`); the data loader splits batches over the ``D``
    data-parallel replicas; the model-parallel group is this rank alone (no tensor or pipeline
    parallelism), so gradient norms count every replicated parameter once. It deliberately has no
    ``initialize_sequence_parallel`` attribute: DeepSpeed takes that as the sign of its own
    sequence-parallel mpu and would then ignore this object's data-parallel group.

    Attributes:
        layout: the degrees and the rank arithmetic.
        rank: this process's rank (in ``group``).
        sequence_parallel_group: the ``U·R`` consecutive ranks sharing one sequence (shards in rank order).
        ulysses_group: the ``U`` consecutive ranks of one all-to-all (same ``d``, ``r``).
        ring_group: the ``R`` ranks with the same ``d``, ``u`` (stride ``U``), in sequence order.
        data_parallel_group: the ``D`` replicas of this rank's position (same ``r``, ``u``).
        sequence_data_parallel_group: all ranks: what ZeRO partitions and reduces over.
        model_parallel_group: this rank alone.
        timeout_s: the bound in seconds on communication waits over these groups, where a call names none.
    """

    layout: RankLayout
    rank: int
    world_group: ProcessGroup | None = field(repr=False)
    sequence_parallel_group: ProcessGroup = field(repr=False)
    ulysses_group: ProcessGroup = field(repr=False)
    ring_group: ProcessGroup = field(repr=False)
    data_parallel_group: ProcessGroup = field(repr=False)
    sequence_data_parallel_group: ProcessGroup = field(repr=False)
    model_parallel_group: ProcessGroup = field(repr=False)
    timeout_s: float
    _controls: dict[int, ProcessGroup | None] = field(repr=False)

    def __init__(
        self,
        data_parallel: int = 1,
        ulysses: int = 1,
        ring: int = 1,
        group: ProcessGroup | None = None,
        *,
        timeout_s: float | None = None,
        ulysses_across_hosts: str = "warn",
    ) -> None:
        timeout_s = resolve_timeout(timeout_s)
        if not dist.is_initialized():
            raise RuntimeError("ds_ring.Topology needs torch.distributed: call init_process_group first")
        world_size = dist.get_world_size(group)
        if group is not None and dist.get_process_group_ranks(group) != list(range(dist.get_world_size())):
            raise ValueError(
                f"group must span every process of the job in rank order (torch.distributed.new_group is "
                f"collective over the whole job), got ranks {dist.get_process_group_ranks(group)} of "
                f"{dist.get_world_size()}; build the Topology on the world (group=None)"
            )
        # Agree before checking: degrees that differ between ranks (some of them maybe invalid) then
        # fail on every rank with each rank's values, instead of some ranks raising while others wait.
        control = control_world(group, timeout_s)
        agree(dict(data_parallel=data_parallel, ulysses=ulysses, ring=ring), group=control, op="Topology",
              timeout_s=timeout_s, fix=_SAME_DEGREES, cache=False)  # fmt: skip
        layout = rank_layout(world_size, data_parallel=data_parallel, ulysses=ulysses, ring=ring)
        check_placement(layout, gather_hosts(control, timeout_s), ulysses_across_hosts)
        rank = dist.get_rank(group)
        world = dist.group.WORLD if group is None else group
        groups, controls = _create_groups(layout, rank, world, control, needs_control_twins(group), timeout_s)
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "rank", rank)
        object.__setattr__(self, "world_group", group)
        object.__setattr__(self, "timeout_s", timeout_s)
        object.__setattr__(self, "_controls", {**controls, id(group): control})
        for role, pg in groups.items():
            object.__setattr__(self, f"{role}_group", pg)

    @classmethod
    def from_config(cls, section: Any, world_size: int) -> Topology:
        """The topology of a ``ring_attention`` config section (see :meth:`RankLayout.from_config`).

        The ranks agree on the section's degrees (and then on the derived ones) before deriving them;
        waits are bounded by the section's ``timeout_s`` when it has one.

        Raises:
            ValueError: degrees that differ between ranks (on every rank), inconsistent degrees, or
                ``world_size`` differing from torch.distributed's.
        """
        if dist.is_initialized() and dist.get_world_size() != world_size:
            raise ValueError(
                f"world_size {world_size} was given but torch.distributed has {dist.get_world_size()} ranks"
            )
        timeout_s = _read(section, "timeout_s")
        degrees = {key: _read(section, key) for key in DEGREE_KEYS}
        agree(degrees, group=control_world(), op="Topology.from_config", timeout_s=timeout_s, fix=_SAME_DEGREES,
              cache=False)  # fmt: skip
        layout = RankLayout.from_config(section, world_size)
        placement = _read(section, "ulysses_across_hosts") or "warn"
        return cls(layout.data_parallel, layout.ulysses, layout.ring, timeout_s=timeout_s,
                   ulysses_across_hosts=placement)  # fmt: skip

    def __copy__(self) -> Topology:
        return self

    def control_group(self, group: ProcessGroup | None) -> ProcessGroup | None:
        """The group for control traffic (agreements, metrics, guards, checkpoint tags: small CPU tensors)
        among the ranks of ``group`` — one of this topology's groups, or ``None``/:attr:`world_group` for all
        of them: the group itself when its backend takes CPU tensors (gloo, or ``"cpu:gloo,cuda:nccl"``),
        else the gloo twin made with the topology.

        Raises:
            ValueError: ``group`` is not one of this topology's groups.
        """
        try:
            return self._controls[id(group)]
        except KeyError:
            raise ValueError("ds_ring: control_group() takes one of this Topology's process groups") from None

    def __deepcopy__(self, memo: dict[int, Any]) -> Topology:
        """A topology is a handle on process groups, which cannot be copied: copies share it
        (so ``copy.deepcopy`` of a model holding one works)."""
        return self

    # Degrees and coordinates ---------------------------------------------------------------------

    @property
    def data_parallel(self) -> int:
        return self.layout.data_parallel

    @property
    def ulysses(self) -> int:
        return self.layout.ulysses

    @property
    def ring(self) -> int:
        return self.layout.ring

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def _coord(self, index: int) -> int:
        return self.layout.coords(self.rank)[index]

    # The mpu interface DeepSpeed reads ------------------------------------------------------------

    def get_data_parallel_group(self) -> ProcessGroup:
        """The group ZeRO-3 partitions parameters over: every rank of the topology (as with DeepSpeed's own
        sequence-parallel mpu). DeepSpeed asks it only to partition (``deepspeed.initialize`` at ZeRO 3
        converting the model) and for MoE / pipeline groups; the data loader's replicas are
        :meth:`get_data_parallel_world_size` / :meth:`get_data_parallel_rank` (the ``D`` replicas), and
        gradients are reduced over :meth:`get_sequence_data_parallel_group` at every stage. The pure
        data-parallel group is :attr:`data_parallel_group`."""
        return self.sequence_data_parallel_group

    def get_data_parallel_world_size(self) -> int:
        return self.layout.data_parallel

    def get_data_parallel_rank(self) -> int:
        return self._coord(0)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.layout.group_of("data_parallel", self.rank))

    def get_model_parallel_group(self) -> ProcessGroup:
        return self.model_parallel_group

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_tensor_model_parallel_world_size(self) -> int:
        """No tensor parallelism: 1 (DeepSpeed's universal checkpoint loading asks)."""
        return 1

    def get_tensor_model_parallel_rank(self) -> int:
        return 0

    def get_sequence_parallel_group(self) -> ProcessGroup:
        return self.sequence_parallel_group

    def get_sequence_parallel_world_size(self) -> int:
        return self.layout.sequence_parallel

    def get_sequence_parallel_rank(self) -> int:
        return self.layout.sequence_parallel_rank(self.rank)

    def get_sequence_data_parallel_group(self) -> ProcessGroup:
        return self.sequence_data_parallel_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.layout.world_size

    def get_sequence_data_parallel_rank(self) -> int:
        return self.rank

    # The sub-groups of the sequence-parallel group ----------------------------------------------

    def get_ulysses_group(self) -> ProcessGroup:
        return self.ulysses_group

    def get_ulysses_world_size(self) -> int:
        return self.layout.ulysses

    def get_ulysses_rank(self) -> int:
        return self._coord(2)

    def get_ring_group(self) -> ProcessGroup:
        return self.ring_group

    def get_ring_world_size(self) -> int:
        return self.layout.ring

    def get_ring_rank(self) -> int:
        return self._coord(1)


def sequence_group(
    where: ProcessGroup | Topology | None, timeout_s: float | None = None
) -> tuple[ProcessGroup | None, float | None]:
    """The process group and wait bound of a call over ``where``: a :class:`Topology`'s sequence-parallel
    group and, unless the call names one, the topology's timeout; a plain group (``None``: the world) as it is."""
    if isinstance(where, Topology):
        return where.sequence_parallel_group, where.timeout_s if timeout_s is None else timeout_s
    return where, timeout_s
