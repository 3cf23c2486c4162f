"""A strategy: how one attention call over sequence shards is computed, and the registry behind ``strategy=``.

A strategy is one object with two parts:

- :meth:`Strategy.check` — pure arithmetic on the call, this rank's shard shape and the degrees of
  its placement: a ``ValueError`` for anything the strategy cannot do (heads that do not split,
  layouts, branches, communication), naming the field and the fix. The ds_config's section
  (``RingAttentionConfig.check``) and every call consult the same method, so the rules of a strategy
  live in its own module.
- :meth:`Strategy.prepare` — plan once (which rows live where, which blocks travel, which
  exchange moves them) and return a :data:`Bound` function that runs the call on tensors of that key
  with no further validation, agreement or host read.

A strategy also owns its other rules, so that ``config.py`` and ``auto`` only iterate the registry:

- :meth:`Strategy.check_degrees` — which ``ulysses_degree`` / ``ring_degree`` a ds_config may give it;
- :meth:`Strategy.options`, :meth:`Strategy.cost` and :meth:`Strategy.memory_q_shards` — its cost and memory model
  (:mod:`ds_ring.strategies.cost`): the ways it can run a call, and the seconds, bytes and memory of each, which
  ``strategy="auto"`` ranks. A strategy that offers no option is never picked by ``auto``.

A new strategy is one module defining a subclass plus one :func:`register_strategy` call: the built-in ones are
registered in ``ds_ring/strategies/__init__.py``; one from outside the package registers itself the same way.
"""

from __future__ import annotations

import dataclasses
import operator
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

import torch
from torch.distributed import ProcessGroup

from ds_ring.kernels.dilated import check_window_branches
from ds_ring.kernels.dilation import check_branches, check_cu_seqlens, check_softcap
from ds_ring.kernels.spans import check_span_options
from ds_ring.strategies.cost import Cost, Link, Option, Problem
from ds_ring.strategies.registry import PLUGINS

__all__ = [
    "AttentionCall",
    "Shape",
    "Degrees",
    "Placement",
    "Bound",
    "Target",
    "Strategy",
    "register_strategy",
    "get_strategy",
    "strategy_names",
    "DEFAULT_STRATEGY",
]

DEFAULT_STRATEGY = "ring"
"""The strategy a call or a ds_config gets when it names none."""

Bound = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]
]
"""A prepared call: ``(q, k, v, sinks) -> (out [B, L, H, Dv], lse [B, L, H])`` for tensors of its key (``lse``
may be ``None`` when the call does not return it and the strategy would have to move it)."""


@dataclass(frozen=True)
class Shape:
    """This rank's shard: ``q [batch, rows, heads, head_dim]``, ``k [batch, rows, kv_heads, head_dim]`` (``v``'s
    head dim may differ; no plan depends on it)."""

    batch: int
    rows: int
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor) -> Shape:
        batch, rows, heads, head_dim = q.shape
        return cls(batch, rows, heads, k.shape[2], head_dim)


@dataclass(frozen=True)
class Degrees:
    """How many ranks share one sequence, as ``ulysses × ring`` (ulysses innermost), and this rank's place
    among them (its sequence-parallel rank, ``r·U + u``)."""

    ulysses: int = 1
    ring: int = 1
    rank: int = 0

    @property
    def sequence(self) -> int:
        return self.ulysses * self.ring


@dataclass(frozen=True, eq=False)
class Placement:
    """The process groups one call spans, and where its control traffic goes.

    ``sequence``: the ``ulysses × ring`` ranks sharing one sequence, shards in group-rank order;
    ``ulysses``: the ranks of one all-to-all (consecutive shards), ``ring``: the ranks with this ulysses
    index, in sequence order (``None``: the degree is 1, or — for a plain group — not split).
    ``control(group)`` is a group of the same ranks whose backend takes CPU tensors (the group itself,
    or a gloo twin a :class:`~ds_ring.Topology` owns), or ``None`` when there is none: control tensors then
    travel on the data's device over the group itself. ``timeout_s`` bounds every wait (``None``: 300 s).
    """

    degrees: Degrees
    sequence: ProcessGroup | None
    ulysses: ProcessGroup | None
    ring: ProcessGroup | None
    timeout_s: float | None
    control: Callable[[ProcessGroup | None], ProcessGroup | None]
    prepared: OrderedDict[tuple, Bound] = field(default_factory=OrderedDict, repr=False)
    """The calls prepared over this placement, by key (:mod:`ds_ring.calls`; the job that owns the placement owns
    them)."""


def _float(value: float | None) -> float | None:
    return None if value is None else float(value)  # 1 and 1.0 are the same scale


def _documents(cu_seqlens: torch.Tensor | Sequence[int] | None) -> tuple[int, ...] | None:
    """The boundaries as a tuple (a tensor's values read back: a host sync on a GPU); checked when prepared."""
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex:
            check_cu_seqlens(cu_seqlens, 0)  # raises the shape / dtype error
        return tuple(cu_seqlens.tolist())
    return tuple(cu_seqlens)


def _nested(value: torch.Tensor | Sequence | int | None) -> tuple | int | None:
    """Span ids / pairs / prefix lengths as nested tuples (a tensor's values read back: a host sync on a GPU)."""
    if value is None or isinstance(value, int):
        return value
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    return tuple(_nested(item) if isinstance(item, (list, tuple, torch.Tensor)) else item for item in value)


def _tensor_facts(tensor: torch.Tensor | None) -> tuple | None:
    return None if tensor is None else (tuple(tensor.shape), tensor.dtype, tensor.device.type)


@dataclass(frozen=True, kw_only=True)
class AttentionCall:
    """How to attend: everything of a call but the tensors, the process groups and the strategy.

    The one carrier of a call's options: the ds_config's section (:meth:`ds_ring.config.RingAttentionConfig.call`),
    the modules and the functions all build one, by keyword. Its branch lists are validated once
    (:meth:`validated`: they become :class:`~ds_ring.kernels.dilation.Lengths`, which nothing validates again); the
    cache key of a prepared call and what its ranks agree on are derived from its fields (:meth:`key`).
    """

    segment_lengths: Sequence[int] | None = None
    """LongNet segment lengths over the *global* sequence; ``None``: dense."""
    dilation_rates: Sequence[int] | None = None
    """One dilation rate per segment length; ``None``: dense."""
    causal: bool = False
    """Causal mask by global position."""
    scale: float | None = field(default=None, metadata={"describe": _float})
    """Softmax scale; ``None``: ``1/sqrt(head_dim)``."""
    communication: str | None = None
    """How K/V move along a ring dimension: a registered exchange (``"ring"``, ``"allgather"``); ``None``: the
    strategy's default (``"ring"``; ``"allgather"`` for strategy ``allgather``; none for ``ulysses``)."""
    layout: str = "contiguous"
    """How the sequence was sharded: ``"contiguous"`` or ``"zigzag"``."""
    head_offset: int = 0
    """Global index of local head 0 (dilation offsets use global head indices)."""
    return_lse: bool = False
    """Also return ``lse [batch, heads, seq/p]``."""
    timeout_s: float | None = field(default=None, metadata={"agreed": False})
    """Bound in seconds on every communication wait; ``None``: the topology's (sequence-parallel strategies) or
    :data:`ds_ring.comm.DEFAULT_TIMEOUT_S` (300 s, plain groups). Each rank's own: not agreed."""
    cu_seqlens: torch.Tensor | Sequence[int] | None = field(default=None, metadata={"describe": _documents})
    """Document boundaries ``[0, e1, ..., seq]`` of a packed global sequence; ``None``: one document. Python
    ints cost nothing per call; a tensor is read back to the host to key the call (a device sync on a GPU)."""
    window: int | None = None
    """Causal sliding window: query ``i`` sees keys ``[i - window + 1, i]`` of its document (dense attention,
    ``causal=True``); ``None``: no window."""
    sinks: torch.Tensor | None = field(default=None, metadata={"describe": _tensor_facts})
    """``[heads]`` attention-sink logits of this rank's query heads (GPT-OSS): one more key per head with that
    score and value 0, differentiable; ``None``: no sink."""
    softcap: float | None = None
    """Attention logit soft-cap (Gemma 2): scores ``s`` become ``softcap·tanh(s / softcap)`` before the softmax;
    ``None``: uncapped."""
    bidirectional_spans: torch.Tensor | Sequence | None = field(default=None, metadata={"describe": _nested})
    """Spans of tokens that see each other fully inside the causal sequence (Gemma 3's image tokens): ``(start,
    stop)`` pairs over the global sequence, or per-token span ids ``[seq]``; ``None``: none. Strategies see them
    resolved (:func:`ds_ring.kernels.spans.resolve_spans`: sorted pairs, prefixes included, ``None`` when empty)."""
    prefix_lengths: int | Sequence[int] | None = field(default=None, metadata={"describe": _nested})
    """Prefix-LM (PaliGemma): the first ``P`` tokens of each document see each other fully (one int, or one per
    document); ``None``: none. Resolved into ``bidirectional_spans`` before a strategy sees the call."""

    def __post_init__(self) -> None:
        # hashable for the key; validated by :meth:`validated`
        if type(self.segment_lengths) is list:
            object.__setattr__(self, "segment_lengths", tuple(self.segment_lengths))
        if type(self.dilation_rates) is list:
            object.__setattr__(self, "dilation_rates", tuple(self.dilation_rates))

    def validated(self) -> AttentionCall:
        """This call with its branch lists validated (:class:`~ds_ring.kernels.dilation.Lengths`, which nothing
        validates again); itself when they are already. The section's call and a module's are validated when made,
        a function's call when it is first prepared (once per key)."""
        segments, rates = check_branches(self.segment_lengths, self.dilation_rates)
        if segments is self.segment_lengths and rates is self.dilation_rates:
            return self
        return dataclasses.replace(self, segment_lengths=segments, dilation_rates=rates)

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> AttentionCall:
        """The call made of the entries of ``options`` that are its fields (e.g. a public function's ``locals()``).
        Runs on every call of the functions: the fields are set as ``__init__`` sets them, without its per-field
        ``object.__setattr__`` (a third of this call's cost on the CPU)."""
        call = object.__new__(cls)
        if options.keys() >= _FIELD_SET:
            call.__dict__.update(zip(FIELDS, _ALL_OPTIONS(options), strict=True))
        else:
            call.__dict__.update(_DEFAULTS, **{name: options[name] for name in FIELDS if name in options})
        call.__post_init__()
        return call

    def key(self) -> tuple:
        """Every field as a hashable value, in :data:`FIELDS` order (document boundaries as a tuple, the sinks as
        their shape, dtype and device type): this call's part of the key of a prepared call. Runs on every call."""
        values = _ALL_FIELDS(self)
        if _DESCRIBED_VALUES(values) == _NONE:  # the common case: no scale, documents or sinks
            return values
        values = list(values)
        for i in _DESCRIBED:
            values[i] = _DESCRIBE[i](values[i])
        return tuple(values)

    def described(self) -> dict[str, Any]:
        """:meth:`key` by field name: what, but for the fields marked not agreed, its ranks agree on."""
        return dict(zip(FIELDS, self.key(), strict=True))

    def check_options(self, rows: int | None = None) -> None:
        """``ValueError`` for a window, a softcap or spans that no strategy can run: a window with branches or
        without ``causal``, a softcap that is not a finite number > 0, bidirectional spans without ``causal``,
        with a window or with branches (the branch lists were checked when the call was made; ``rows`` is kept
        for callers that passed this rank's shard length)."""
        check_window_branches(self.window, self.causal, self.segment_lengths)
        check_softcap(self.softcap)
        spans = self.bidirectional_spans if self.prefix_lengths is None else self.prefix_lengths
        check_span_options(spans, self.causal, self.window, self.segment_lengths)


FIELDS: tuple[str, ...] = tuple(f.name for f in fields(AttentionCall))
"""The options of an attention call, in declaration order."""
_DESCRIBE = tuple(f.metadata.get("describe") for f in fields(AttentionCall))
_DESCRIBED = tuple(i for i, describe in enumerate(_DESCRIBE) if describe is not None)
_ALL_FIELDS = operator.attrgetter(*FIELDS)
_ALL_OPTIONS = operator.itemgetter(*FIELDS)
_FIELD_SET = frozenset(FIELDS)
_DEFAULTS = {f.name: f.default for f in fields(AttentionCall)}
_DESCRIBED_VALUES = operator.itemgetter(*_DESCRIBED)
_NONE = (None,) * len(_DESCRIBED)
NOT_AGREED: frozenset[str] = frozenset(f.name for f in fields(AttentionCall) if not f.metadata.get("agreed", True))
"""Fields each rank may set for itself (they key its cache but are not compared across ranks)."""


class Target(NamedTuple):
    """What a call is prepared for: this rank's shard ``shape``, the ``placement`` of its groups, the ``device``
    of its tensors, and its ``documents`` (checked ``cu_seqlens`` over the global sequence; ``None``: one)."""

    shape: Shape
    placement: Placement
    device: torch.device
    documents: tuple[int, ...] | None


class Strategy(ABC):
    """How attention over sequence shards is computed and how K/V (or heads) move between ranks."""

    name: str = ""
    buffers: dict[str, float] = {}
    """The memory model's fitted coefficients, by name (``python -m benchmarks.auto_fit --fit``); never mutated."""

    def default_communication(self) -> str | None:
        """The ``communication`` a call gets when it names none (``None``: the strategy moves no K/V blocks)."""
        return "ring"

    @abstractmethod
    def check(self, call: AttentionCall, shape: Shape | None, degrees: Degrees | None) -> None:
        """``ValueError`` for anything this strategy cannot do with ``call`` (``communication`` resolved) on
        shards of ``shape`` over ``degrees``; no communication, no tensor read. Without ``shape`` / ``degrees``
        (a ds_config read before the run is known) only the rules that need neither are checked."""

    @abstractmethod
    def prepare(self, call: AttentionCall, target: Target) -> Bound:
        """Plan ``call`` (checked, its ranks agreed) once for ``target``; return the function that runs it."""

    def check_degrees(self, ulysses_degree: int | None, ring_degree: int | None) -> None:
        """``ValueError`` for degrees a ds_config may not give this strategy (``None``: not given), its message
        starting with the field or ``strategy`` (the section's name and a dot are prefixed: ``"ulysses_degree is 2
        but ..."``) and naming the fix. By default every degree is allowed."""
        return None

    def options(self, problem: Problem) -> list[Option]:
        """The ways this strategy can run ``problem`` (layouts, exchange, degrees, ring chunk), unchecked: ``auto``
        checks each with :meth:`check` and ranks the valid ones by :meth:`cost`. By default none: ``auto`` never
        picks the strategy."""
        return []

    def cost(self, problem: Problem, option: Option, link: Link) -> Cost:
        """The predicted cost per rank of one of :meth:`options` under ``link`` (calibrated rates)."""
        raise NotImplementedError(f"strategy {self.name!r} has no cost model")

    def memory_q_shards(self, problem: Problem, option: Option, buffers: dict[str, float] | None = None) -> float:
        """Predicted extra memory per rank of one call (over q, k, v, dout), in q-shards; ``buffers`` overrides
        the strategy's fitted coefficients (:attr:`buffers`) by name."""
        raise NotImplementedError(f"strategy {self.name!r} has no memory model")


def check_missing_dimension(strategy: str, dimension: str, field: str, degree: int | None) -> None:
    """For :meth:`Strategy.check_degrees`: ``ValueError`` unless ``degree`` (the ds_config's ``field``) is unset or 1,
    since ``strategy`` has no ``dimension`` (``"Ulysses"``, ``"ring"``) to give it."""
    if degree not in (None, 1):
        raise ValueError(
            f"{field} is {degree} but strategy {strategy!r} has no {dimension} dimension; set {field} to 1 (or remove "
            "it), or use strategy 'hybrid'"
        )


def register_strategy(strategy: Strategy) -> None:
    """Make ``strategy`` selectable as ``strategy=strategy.name`` (in calls and in the ds_config)."""
    PLUGINS.strategies.register(strategy.name, strategy)


def get_strategy(name: str) -> Strategy:
    """The strategy registered as ``name``; ``ValueError`` listing the choices otherwise."""
    return PLUGINS.strategies.get(name)


def strategy_names() -> tuple[str, ...]:
    """Names of the registered strategies, in registration order."""
    return PLUGINS.strategies.names()
