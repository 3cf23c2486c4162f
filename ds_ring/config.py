"""The ``"ring_attention"`` section of a DeepSpeed ``ds_config.json``.

DeepSpeed ignores top-level keys it does not know, so ds_ring reads and validates its own section.
Everything that can be checked from the file alone is checked when it loads; what needs the
world size, the model's heads or the sequence length is checked by :meth:`RingAttentionConfig.check`
before any collective. Every rejection is a ``ValueError`` (pydantic's ``ValidationError`` is one)
naming the field, the value given and the fix.

Example::

    "ring_attention": {
        "strategy": "ring", "communication": "ring",
        "sequence_parallel_size": 2,
        "segment_lengths": [2048, 8192], "dilation_rates": [1, 4],
        "causal": true, "timeout_s": 120,
        "monitoring": {"metrics": true, "watchdog": true, "step_timeout_s": 900, "numerics_guard": "warn"}
    }

``monitoring.metrics`` writes through DeepSpeed's monitor, so the ds_config must enable one of its
backends (``"csv_monitor"``, ``"tensorboard"``, ``"wandb"``, ``"comet"``); :func:`ds_ring.initialize`
checks that before any collective.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import signal
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from ds_ring.auto import Auto  # importing ds_ring.auto registers strategy "auto"
from ds_ring.comm.wait import DEFAULT_TIMEOUT_S
from ds_ring.parallel.layout import RankLayout
from ds_ring.strategies import DEFAULT_STRATEGY, AttentionCall, Degrees, Shape, exchanges, get_strategy, strategy_names
from ds_ring.strategies.base import FIELDS

__all__ = [
    "RingAttentionConfig", "MonitoringConfig", "LongContextConfig", "PreemptionConfig", "load_config", "read_ds_config",
    "read_section", "DsConfig", "SECTION",
]  # fmt: skip

SECTION = "ring_attention"


def _refuse_unknown_keys(data: Any, known: Mapping[str, Any], where: str) -> None:
    """``ValueError`` naming every key of ``data`` not in ``known``, with the closest known key."""
    if not isinstance(data, Mapping):
        return
    unknown = [key for key in data if key not in known]
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(str(key), known, n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ValueError(f"{where}: unknown key(s) {', '.join(hints)}; known keys: {', '.join(known)}")


class _Section(DeepSpeedConfigModel):
    """An object of the ds_config whose unknown keys are refused, each with the closest known key."""

    _WHERE: ClassVar[str] = SECTION
    """Where the object sits in the ds_config, as errors name it (e.g. ``"ring_attention.monitoring"``)."""

    @model_validator(mode="before")
    @classmethod
    def _suggest_for_unknown_keys(cls, data: Any) -> Any:
        _refuse_unknown_keys(data, cls.model_fields, cls._WHERE)
        return data


class MonitoringConfig(_Section):
    """Built-in monitoring hooks (the ``"monitoring"`` object inside ``"ring_attention"``)."""

    _WHERE = f"{SECTION}.monitoring"

    metrics: bool = False
    """Per training step, write attention compute time, communication time, the share of
    communication hidden behind compute, bytes sent and received and peak memory (min and max over
    ranks) through DeepSpeed's monitor from rank 0. Needs a DeepSpeed monitor backend enabled."""

    watchdog: bool = True
    """Log every communication error (timeout after ``timeout_s`` or failed peer) the moment it is
    raised, naming this rank, the peer, the training step, the layer and the operation."""

    step_timeout_s: float | None = Field(None, gt=0)
    """With ``watchdog``: a training step still running after this many seconds (a hang outside
    ds_ring's bounded waits) makes the process dump every thread's stack and exit with code 1.
    ``null``: no step deadline. Must exceed a whole step, checkpointing included."""

    numerics_guard: Literal["off", "warn", "raise", "skip_step"] = "off"
    """What a NaN or Inf in an attention output or LSE (``+inf``; ``-inf`` marks rows no key covers)
    does: nothing (``off``), a warning naming the layer and rank (``warn``), a ``NumericsError``
    (``raise``), or a warning and the step skipped on every rank (``skip_step``, when the training
    loop asks ``engine.ring_monitor.skip_step()``)."""


class PreemptionConfig(_Section):
    """What a preemption signal does (the ``"preemption"`` object inside ``"ring_attention"``;
    :mod:`ds_ring.engine.preemption`)::

        "preemption": {"enabled": true, "signals": ["SIGTERM", "SIGUSR1"], "grace_s": 25}
    """

    _WHERE = f"{SECTION}.preemption"

    enabled: bool = True
    """Catch ``signals``: the ranks stop together at the end of the current step, save it and exit 0 (in a loop that
    runs its steps in ``engine.preemption.step_in_flight``, a step longer than half of ``grace_s`` is abandoned and
    the step before it saved). Only once the training loop polls ``engine.preemption.stop_requested()`` or enters
    ``step_in_flight``; before that (or with ``false``) a signal does what it did without ds_ring."""

    signals: list[str] = Field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    """Signal names that announce a preemption: SIGTERM (SLURM, Kubernetes, the launchers), SIGUSR1 (SLURM's
    ``--signal=USR1@90``)."""

    grace_s: float = Field(25.0, gt=0)
    """Seconds from the first signal to the end of the process: past them it exits with code 124 wherever it is,
    without touching the last complete checkpoint. Keep it below the time the sender waits before SIGKILL (torchrun
    and the ``deepspeed`` launcher: 30 s; Kubernetes: ``terminationGracePeriodSeconds``, 30 s by default; SLURM: the
    ``@`` of ``--signal``)."""

    repeat_window_s: float = Field(2.0, ge=0)
    """A signal within this many seconds of the first is the same preemption delivered twice (a launcher forwarding
    what its process group also received) and is ignored; a later one ends the process at once (code 128 + signal)."""

    @field_validator("signals")
    @classmethod
    def _known_signals(cls, names: list[str]) -> list[str]:
        unknown = [name for name in names if not isinstance(getattr(signal, name, None), signal.Signals)]
        if unknown or not names or "SIGKILL" in names or "SIGSTOP" in names:
            raise ValueError(
                f"{SECTION}.preemption.signals {names} must be a non-empty list of catchable signal names such as "
                f"'SIGTERM', 'SIGUSR1' (not SIGKILL or SIGSTOP); unknown: {unknown}"
            )
        return names


class LongContextConfig(_Section):
    """What keeps the rest of a Hugging Face model O(seq/p) per rank (the ``"long_context"`` object inside
    ``"ring_attention"``), applied by ``session.apply_long_context(model)`` (the session ``register_with_transformers``
    returns) to the model it is given::

        "long_context": {"tiled_loss": true, "tiled_mlp": true, "tile_tokens": 2048, "offload_checkpoints": "none"}
    """

    _WHERE = f"{SECTION}.long_context"

    tiled_loss: bool = False
    """With ``shift_labels`` in the batch, ``model(**batch).loss`` is the sequence-group mean computed tile by tile
    (LM head and cross-entropy on ``tile_tokens`` tokens at a time, ``[tokens, vocab]`` never held) and
    ``.logits`` is ``None``."""

    tiled_mlp: bool = False
    """Every decoder MLP runs over tiles of ``tile_tokens`` tokens, its activations recomputed per tile in the
    backward (ZeRO-3: each weight gathered once per forward and once per backward, its gradient reduced once)."""

    tile_tokens: int = 2048
    """Tokens per tile (batch × this rank's shard, flattened); the last tile may be shorter."""

    offload_checkpoints: Literal["none", "host", "disk"] = "none"
    """Where the layer inputs gradient checkpointing keeps go until the layer's recompute: ``"host"`` (pinned host
    memory; on a CPU they stay where they are), ``"disk"`` (a memory-mapped file in ``offload_dir``, which shrinks
    resident memory on a CPU too). Turns gradient checkpointing on."""

    offload_dir: str | None = None
    """The existing, writable directory ``"disk"`` writes to (its files are unlinked at once: nothing stays)."""

    offload_recompute: bool = False
    """With ``offload_checkpoints``: the activations a layer's recompute saves for its backward go to the same
    store too (each read back when its backward op runs, shared when several ops save it), so one layer's
    activations are never resident at once. Costs a write and a read of them per step."""

    @field_validator("tile_tokens")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value <= 0:
            raise ValueError(
                f"{SECTION}.long_context.tile_tokens must be a positive number of tokens, got {value}; use e.g. 2048"
            )
        return value

    @model_validator(mode="after")
    def _offload_dir_usable(self) -> LongContextConfig:
        where = f"{SECTION}.long_context.offload_dir"
        if self.offload_recompute and self.offload_checkpoints == "none":
            raise ValueError(
                f"{SECTION}.long_context.offload_recompute needs a store: set offload_checkpoints to 'disk' (or "
                f"'host'), or offload_recompute to false"
            )
        if self.offload_checkpoints != "disk":
            return self
        if not self.offload_dir:
            raise ValueError(
                f"{where} is missing: offload_checkpoints 'disk' writes to a directory; set offload_dir to an existing "
                f"writable directory (a local disk, not a network mount)"
            )
        if not os.path.isdir(self.offload_dir):
            raise ValueError(f"{where} {self.offload_dir!r} is not an existing directory; create it or choose another")
        try:
            tempfile.TemporaryFile(dir=self.offload_dir).close()
        except OSError as err:
            raise ValueError(
                f"{where} {self.offload_dir!r} is not writable ({err.strerror}); choose a directory this process "
                f"can write to"
            ) from None
        return self

    @property
    def enabled(self) -> bool:
        """Whether anything is switched on."""
        return self.tiled_loss or self.tiled_mlp or self.offload_checkpoints != "none"


class RingAttentionConfig(_Section):
    """Sequence-parallel attention settings (the ``"ring_attention"`` section)."""

    enabled: bool = True
    """Use ds_ring's sequence-parallel attention. ``false`` runs every attention on the whole sequence."""

    strategy: str = DEFAULT_STRATEGY
    """``"ring"``/``"allgather"`` (K/V move between sequence shards), ``"ulysses"`` (all-to-all from
    sequence to head sharding), ``"hybrid"`` (Ulysses inside ``ulysses_degree`` ranks, ring across), or ``"auto"``
    (per call, the fastest of those the degrees admit by a cost model and a link probe, the same on every rank;
    ``python -m ds_ring.auto`` shows the choice and the degrees to set before the run)."""

    communication: str | None = None
    """How the ring dimension moves K/V: ``"ring"`` (passed rank to rank, O(n/p) memory), ``"allgather"``
    (fewer syncs), or any exchange registered with ``ds_ring.strategies.register_exchange``. Absent: the
    strategy's default (``ring``; strategy ``allgather`` all-gathers; ``ulysses`` has no ring dimension and
    refuses one)."""

    sequence_parallel_size: int | None = Field(None, ge=1)
    """Ranks that share one sequence (default: ``ulysses_degree × ring_degree``, or the whole world)."""

    ulysses_degree: int | None = Field(None, ge=1)
    """Ranks of the Ulysses (head-sharding) dimension: ``hybrid`` and ``ulysses`` only."""

    ring_degree: int | None = Field(None, ge=1)
    """Ranks of the ring dimension: ``hybrid``, ``ring`` and ``allgather``."""

    segment_lengths: list[int] | None = None
    """LongNet segment lengths over the global sequence; absent (with ``dilation_rates``) = dense."""

    dilation_rates: list[int] | None = None
    """One dilation rate per segment length."""

    causal: bool = True
    """Causal mask by global position."""

    layout: Literal["contiguous", "zigzag"] = "contiguous"
    """How the sequence is cut into shards; ``zigzag`` balances causal dense attention over a ring."""

    timeout_s: float = Field(DEFAULT_TIMEOUT_S, gt=0)
    """Bound in seconds on every communication wait (ds_ring's, through the :class:`~ds_ring.Topology` it
    builds and the monitor's collectives, and, when ds_ring starts ``torch.distributed``, the process
    group's); expiry raises an error naming rank, peer and step."""

    ulysses_across_hosts: Literal["warn", "error", "allow"] = "warn"
    """What the :class:`~ds_ring.Topology` does when a Ulysses group's ranks run on several hosts (its
    all-to-alls then cross the network in every layer): warn naming the ranks and hosts, raise a
    ``ValueError`` (``"error"``: strict placement), or nothing (``"allow"``). Hosts are ``socket.gethostname()``."""

    monitoring: MonitoringConfig = Field(default_factory=MonitoringConfig)
    """Built-in hooks: per-step metrics, the watchdog and the numerics guard (:class:`MonitoringConfig`)."""

    long_context: LongContextConfig = Field(default_factory=LongContextConfig)
    """Tiled loss, tiled MLP and offloaded checkpoints for a Hugging Face model (:class:`LongContextConfig`)."""

    preemption: PreemptionConfig = Field(default_factory=PreemptionConfig)
    """Stop, save and exit 0 on SIGTERM / SIGUSR1 (:class:`PreemptionConfig`)."""

    _call: tuple[str, AttentionCall] | None = PrivateAttr(None)

    def __init__(self, strict: bool = False, **data: Any) -> None:
        # DeepSpeedConfigModel drops every value "auto" (Hugging Face's placeholder) unless strict; here
        # "strategy": "auto" is a choice of its own, so it is kept (other "auto" values are dropped as before).
        if not strict and data.get("strategy") == Auto.name:
            data, strict = {k: v for k, v in data.items() if v != "auto" or k == "strategy"}, True
        super().__init__(strict=strict, **data)

    @field_validator("strategy", "communication")
    @classmethod
    def _registered(cls, value: str | None, info: ValidationInfo) -> str | None:
        names = strategy_names() if info.field_name == "strategy" else exchanges()
        if value is not None and value not in names:
            raise ValueError(f"{SECTION}.{info.field_name} {value!r} is not one of {list(names)}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> RingAttentionConfig:
        try:
            self._strategy_check(None, None)
        except ValueError as err:
            raise ValueError(f"{SECTION}: {err}") from None
        try:
            get_strategy(self.strategy).check_degrees(self.ulysses_degree, self.ring_degree)
        except ValueError as err:
            raise ValueError(f"{SECTION}.{err}") from None  # the strategy's message starts with the field
        if None not in (self.sequence_parallel_size, self.ulysses_degree, self.ring_degree):
            product = self.ulysses_degree * self.ring_degree
            if product != self.sequence_parallel_size:
                raise ValueError(
                    f"{SECTION}: ulysses_degree {self.ulysses_degree} × ring_degree {self.ring_degree} = {product} "
                    f"≠ sequence_parallel_size {self.sequence_parallel_size}; make the product equal it"
                )
        return self

    def degrees(self, world_size: int) -> tuple[int, int, int]:
        """``(data_parallel, ulysses, ring)`` for ``world_size`` ranks, as the :class:`~ds_ring.Topology`
        built from this section will have them; ``ValueError`` naming every factor."""
        try:
            layout = RankLayout.from_config(self, world_size)
        except ValueError as err:
            raise ValueError(f"{SECTION}: {err}") from None
        return layout.data_parallel, layout.ulysses, layout.ring

    def call(self) -> AttentionCall:
        """The section's share of every attention call (:data:`CALL_FIELDS`), as the one carrier the modules and
        functions build too; made (and its branch lists validated) once per value of those fields."""
        values = {name: getattr(self, name) for name in CALL_FIELDS}
        key = repr(sorted(values.items()))
        if self._call is None or self._call[0] != key:
            self._call = (key, AttentionCall(**values).validated())
        return self._call[1]

    def call_settings(self) -> dict[str, Any]:
        """:meth:`call`'s fields as ``RingDilatedAttention.configure`` takes them (no validation repeated)."""
        call = self.call()
        return {name: getattr(call, name) for name in CALL_FIELDS}

    def _strategy_check(self, shape: Shape | None, degrees: Degrees | None) -> None:
        strategy = get_strategy(self.strategy)
        call = self.call()
        if call.communication is None:
            call = dataclasses.replace(call, communication=strategy.default_communication())
        strategy.check(call, shape, degrees)

    def check(
        self, *, world_size: int, num_heads: int, num_kv_heads: int | None = None, seq_len: int | None = None
    ) -> None:
        """Check the section against the run (ranks, model heads, sequence length), before any collective.

        The strategy's own :meth:`~ds_ring.strategies.Strategy.check` decides, with the rules every call is
        checked by. Without ``seq_len`` the shard and segment checks wait for the first attention call
        (which raises the same errors before communicating).
        """
        _, ulysses, ring = self.degrees(world_size)
        sp = ulysses * ring
        if num_kv_heads is not None and (num_kv_heads < 1 or num_heads % num_kv_heads):
            raise ValueError(
                f"{SECTION}: {num_heads} attention heads are not a multiple of num_key_value_heads {num_kv_heads} "
                f"(grouped-query attention shares each K/V head among heads / kv_heads query heads); fix the model "
                f"config's num_key_value_heads"
            )
        if seq_len is not None:
            chunks = sp * (2 if self.layout == "zigzag" else 1)
            if seq_len % chunks:
                raise ValueError(
                    f"{SECTION}: sequence length {seq_len} must be divisible by {chunks} (sequence_parallel_size {sp}"
                    f"{', ×2 for zigzag' if self.layout == 'zigzag' else ''}); pad or trim the data to a multiple of "
                    f"{chunks}"
                )
        rows = seq_len // sp if seq_len is not None else 2 * sp  # any even shard when the length is not known
        shape = Shape(1, rows, num_heads, num_kv_heads or num_heads, 1)
        try:
            self._strategy_check(shape, Degrees(ulysses, ring))
        except ValueError as err:
            length = f" with sequence length {seq_len}" if seq_len is not None else ""
            raise ValueError(f"{SECTION} (strategy {self.strategy!r}, {num_heads} heads{length}): {err}") from None


CALL_FIELDS: tuple[str, ...] = tuple(name for name in FIELDS if name in RingAttentionConfig.model_fields)
"""The options of an attention call the section sets (the fields it shares with :class:`AttentionCall`)."""


def read_ds_config(ds_config: str | PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """A whole ds_config as a dict: a mapping as it is, a ``.yaml``/``.yml`` file as YAML, any other as JSON.

    Raises ``ValueError`` naming the file, line and column of a syntax error, or when the top level
    is not an object.
    """
    if isinstance(ds_config, Mapping):
        return dict(ds_config)
    path = Path(ds_config)
    text = path.read_text()
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ValueError(f"{path}: YAML syntax error{where}: {getattr(err, 'problem', None) or err}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: JSON syntax error at line {err.lineno}, column {err.colno}: {err.msg}") from None
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: a ds_config is an object of sections at the top level, got {type(data).__name__}")
    return dict(data)


def load_config(ds_config: str | PathLike | Mapping[str, Any]) -> RingAttentionConfig:
    """The validated ``"ring_attention"`` section of a whole ds_config (a JSON or YAML path, or a dict), as written.

    A ds_config without the section gives ``RingAttentionConfig(enabled=False)``. Entry points that run with the
    section use :func:`read_section` (``enabled: false`` normalised, the ranks' agreement).
    """
    ds_config = read_ds_config(ds_config)
    section = ds_config.get(SECTION)
    if section is None:
        return RingAttentionConfig(enabled=False)
    if not isinstance(section, Mapping):
        raise ValueError(f"{SECTION} must be a JSON object, got {section!r}")
    return RingAttentionConfig(strict=True, **section)


@dataclass(frozen=True)
class DsConfig:
    """A whole ds_config and its validated, normalised ``ring_attention`` section (what :func:`read_section` gives)."""

    whole: dict[str, Any]
    """The ds_config as read (``{}`` when none was given); DeepSpeed gets it without the section."""

    section: RingAttentionConfig
    """The section; with ``enabled: false``, one without sequence parallelism (:func:`read_section`)."""

    @property
    def zero_optimization(self) -> Mapping[str, Any] | None:
        """The ds_config's ``zero_optimization`` (``None``: not given, DeepSpeed's ZeRO 0)."""
        return self.whole.get("zero_optimization")

    def agree(self, seq_len: int | None = None, *, op: str = "ds_ring.initialize") -> None:
        """Collective over every rank: ``ValueError`` on every rank unless all read the same section (and ``seq_len``).

        Fields are compared after validation (defaults filled in), so a key left at its default on one rank and
        written out on another agrees; the message names ``ring_attention.<field>`` and each rank's value. One small
        all-gather over the world's control group, bounded by the section's ``timeout_s``; nothing without
        ``torch.distributed`` started. ``op``: the entry point, named in the error.
        """
        from ds_ring.comm.agree import agree
        from ds_ring.parallel.groups import control_world

        fields: dict[str, Any] = {"seq_len": seq_len}
        for key, value in self.section.model_dump().items():
            if isinstance(value, Mapping):
                fields.update({f"{SECTION}.{key}.{inner}": v for inner, v in value.items()})
            else:
                fields[f"{SECTION}.{key}"] = value
        agree(fields, group=control_world(), op=op, timeout_s=self.section.timeout_s,
              fix=_SAME_SECTION, cache=False)  # fmt: skip


_SAME_SECTION = f"give every rank the same {SECTION} section (the same ds_config on every node) and the same seq_len"


def read_section(config: str | PathLike | Mapping[str, Any] | None) -> DsConfig:
    """The one reader of a ds_config for ds_ring's entry points (``ds_ring.initialize``, ``register_with_transformers``,
    ``SequenceParallelTrainer``, ALST's names): the whole ds_config and its validated, normalised section.

    No communication: entry points call :meth:`DsConfig.agree` once ``torch.distributed`` is up, so malformed input is
    refused on every rank before any process group starts.

    Args:
        config: the whole ds_config: a JSON/YAML path or a dict. ``None``: no ds_config, the default section (dense
            ring attention over every rank) and DeepSpeed's ZeRO defaults.

    Returns:
        The :class:`DsConfig`. ``enabled: false`` (or no section) means *no sequence parallelism*: every rank is a
        data-parallel replica of its own (``sequence_parallel_size`` 1), every attention runs on the whole sequence
        its rank holds, and the section's attention fields (strategy, degrees, branches, layout, causal) are dropped
        for their defaults; ``timeout_s``, ``monitoring``, ``preemption`` and ``long_context`` still apply.

    Raises:
        ValueError: a syntax error, a malformed section (naming the field and the fix), or a dict that looks like
            the section itself rather than a whole ds_config.
    """
    if config is None:
        return DsConfig({}, RingAttentionConfig())
    if isinstance(config, Mapping) and SECTION not in config and "strategy" in config:
        raise ValueError(
            f"config must be a whole ds_config (with a {SECTION!r} section), got what looks like the section "
            f"itself; pass {{{SECTION!r}: {{...}}, ...}}"
        )
    whole = read_ds_config(config)
    section = load_config(whole)
    if not section.enabled:
        kept = {key: getattr(section, key) for key in ("timeout_s", "monitoring", "preemption", "long_context")}
        section = RingAttentionConfig(enabled=False, sequence_parallel_size=1, **kept)
    return DsConfig(whole, section)
