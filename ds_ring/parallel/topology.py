"""Process groups of sequence-parallel training: data × ring × ulysses.

A :class:`Topology` is built once, after ``torch.distributed.init_process_group``, and passed
explicitly to whatever needs a group (attention modules, ``deepspeed.initialize(mpu=...)``);
there is no module-level singleton. Building one takes three steps: the ranks agree on the degrees,
check where the Ulysses groups fall on the hosts, and create the groups (with their control twins)
of the rank layout (:class:`~ds_ring.parallel.layout.RankLayout`). The getters DeepSpeed reads are
:class:`~ds_ring.parallel.mpu.DeepSpeedMpu`'s.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup

from ds_ring.comm.agree import agree
from ds_ring.comm.job import job
from ds_ring.comm.wait import resolve_timeout
from ds_ring.compiler.custom_ops import register
from ds_ring.parallel.groups import control_world, create_groups
from ds_ring.parallel.layout import DEGREE_KEYS, RankLayout, rank_layout, read_key
from ds_ring.parallel.mpu import DeepSpeedMpu
from ds_ring.parallel.ulysses_hosts import check_placement, gather_hosts

__all__ = ["Topology", "sequence_group"]

_SAME_DEGREES = (
    "build the Topology with the same degrees on every rank (the same ds_config and launch arguments on every node)"
)


def _layout_degree(name: str) -> property:
    """A read-only property of a :class:`Topology`: its layout's ``name`` (a number of ranks)."""
    return property(lambda self: getattr(self.layout, name), doc=f"The layout's ``{name}`` (ranks).")


@dataclass(frozen=True, eq=False, init=False)
class Topology(DeepSpeedMpu):
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
    here has twice it as its process-group timeout (the backend's watchdog stays the backstop), and so has the
    group of every rank: ``group`` (the world) when its own timeout is as long, else a new group of the same ranks,
    with a warning naming both timeouts (:func:`~ds_ring.parallel.groups.create_groups`). The ranks then
    exchange their hosts (:func:`~ds_ring.parallel.ulysses_hosts.gather_hosts`, named in communication errors
    from then on) and check that no Ulysses group spans several hosts
    (:func:`~ds_ring.parallel.ulysses_hosts.check_placement`): ``ulysses_across_hosts`` ``"warn"`` (a
    :class:`~ds_ring.parallel.ulysses_hosts.PlacementWarning` naming the ranks and hosts), ``"error"`` (a
    ``ValueError`` on every rank) or ``"allow"``.

    It is DeepSpeed's ``mpu`` (:class:`~ds_ring.parallel.mpu.DeepSpeedMpu`): pass it as
    ``deepspeed.initialize(..., mpu=topology)``. Mind the two data-parallel groups: DeepSpeed's
    :meth:`get_data_parallel_group` is every rank sharing gradients (all ``D·U·R``), while
    :attr:`data_parallel_group` holds the ``D`` replicas only.

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
        hosts: every global rank's host, in rank order, as this topology gathered them.
        places: every global rank's CPU place (:class:`~ds_ring.comm.cores.CpuPlace`), in rank order.
        compile_handle: how ``torch.compile``'d calls over this topology name it (:mod:`ds_ring.compiler.attention_op`).

    The first topology of a job records its hosts and places as the job's (:class:`ds_ring.comm.job.Job`, what
    communication errors and ``strategy="auto"`` read); a later one keeps its own and overwrites nothing.
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
    hosts: tuple[str, ...] = field(repr=False)
    places: tuple[Any, ...] = field(repr=False)
    _controls: dict[int, ProcessGroup | None] = field(repr=False)
    compile_handle: int = field(repr=False)

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
        hosts, places = gather_hosts(control, timeout_s)
        check_placement(layout, hosts, ulysses_across_hosts)
        job().record_facts(hosts, places)
        rank = dist.get_rank(group)
        world = dist.group.WORLD if group is None else group
        groups = create_groups(layout, rank, world, control, timeout_s)
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "hosts", hosts)
        object.__setattr__(self, "places", places)
        object.__setattr__(self, "rank", rank)
        object.__setattr__(self, "world_group", group)
        object.__setattr__(self, "timeout_s", timeout_s)
        object.__setattr__(self, "_controls", {**groups.controls, id(group): groups.controls[id(world)]})
        # how a call over this topology names it under torch.compile (compiler/attention_op.py), not keeping it alive
        object.__setattr__(self, "compile_handle", register(weakref.ref(self)))
        for role, pg in groups.mine.items():
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
        timeout_s = read_key(section, "timeout_s")
        degrees = {key: read_key(section, key) for key in DEGREE_KEYS}
        agree(degrees, group=control_world(), op="Topology.from_config", timeout_s=timeout_s,
              fix=_SAME_DEGREES, cache=False)  # fmt: skip
        layout = RankLayout.from_config(section, world_size)
        placement = read_key(section, "ulysses_across_hosts") or "warn"
        return cls(layout.data_parallel, layout.ulysses, layout.ring, timeout_s=timeout_s,
                   ulysses_across_hosts=placement)  # fmt: skip

    def __copy__(self) -> Topology:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Topology:
        """A topology is a handle on process groups, which cannot be copied: copies share it
        (so ``copy.deepcopy`` of a model holding one works)."""
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

    data_parallel = _layout_degree("data_parallel")
    ulysses = _layout_degree("ulysses")
    ring = _layout_degree("ring")
    world_size = _layout_degree("world_size")


def sequence_group(
    where: ProcessGroup | Topology | None, timeout_s: float | None = None
) -> tuple[ProcessGroup | None, float | None]:
    """The process group and wait bound of a call over ``where``: a :class:`Topology`'s sequence-parallel
    group and, unless the call names one, the topology's timeout; a plain group (``None``: the world) as it is."""
    if isinstance(where, Topology):
        return where.sequence_parallel_group, where.timeout_s if timeout_s is None else timeout_s
    return where, timeout_s
