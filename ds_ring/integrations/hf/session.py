"""The handle of one registration with transformers: what every sequence-parallel call of a Hugging Face model takes.

:func:`~ds_ring.integrations.hf.registration.register_with_transformers` returns a :class:`SequenceParallelSession`;
:func:`~ds_ring.integrations.hf.batches.shard_batch`, :func:`~ds_ring.integrations.hf.loss.causal_lm_loss`,
:class:`~ds_ring.integrations.hf.batches.SequenceParallelDataLoader` and
:class:`~ds_ring.integrations.hf.alst.UlyssesSPDataLoaderAdapter` take it explicitly, so two models, two
registrations or a test that forgot to close one can never make a call read another's section, topology or
gradient scale. Nothing in ds_ring remembers "the last registration"; the registries of transformers are the only
record of what is installed (:func:`installed_sessions`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ds_ring.integrations.hf.attention import SequenceParallelAttention
from ds_ring.integrations.hf.long_context import apply_long_context, check_long_context
from ds_ring.integrations.internal import RingAttentionConfig, Topology

__all__ = ["SequenceParallelSession", "installed_sessions", "require_session"]


@dataclass(frozen=True, eq=False)
class SequenceParallelSession:
    """One registration with transformers: its section, topology and engine's gradient scale, and how to undo it.

    Use it as a context manager (``with register_with_transformers(...) as session:``) or call :meth:`close`: either
    puts back every registry entry it replaced and undoes :meth:`apply_long_context`.
    """

    section: RingAttentionConfig
    """The validated ``ring_attention`` section (``enabled: false``: no sequence parallelism, nothing registered)."""

    topology: Topology
    """The process groups: the ``mpu`` for ``deepspeed.initialize``."""

    zero_optimization: Mapping[str, Any] | None
    """The ds_config's ``zero_optimization`` the engine is built with (``None``: not given)."""

    attention: SequenceParallelAttention | None
    """The function in transformers' attention registry (``None`` when the section is disabled)."""

    vision: Any = None
    """A vision-language model's :class:`~ds_ring.integrations.hf.vision.VisionLanguage` (``None``: a text model):
    :func:`~ds_ring.integrations.hf.batches.shard_batch` then leaves the sequence whole for the model's merge and
    the cut before its language model takes this rank's rows."""

    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)  # what close() runs, last first

    @property
    def gradient_scale(self) -> int:
        """The factor ds_ring's losses put on each rank's gradient share for this model's engine: what
        :func:`ds_ring.engine.gradient_scale.parameter_gradient_scale` read off the model's parameters at its first
        attention call (1 before any call, and without sequence-parallel attention)."""
        scale = None if self.attention is None else self.attention.gradient_scale
        return 1 if scale is None else scale

    @property
    def installed(self) -> bool:
        """Whether transformers' registries still hold this session's attention."""
        return any(session is self for session in installed_sessions())

    def apply_long_context(self, model: nn.Module) -> None:
        """Apply the section's ``long_context`` (tiled loss and MLP, offloaded checkpoints) to ``model``'s instance
        (:mod:`ds_ring.integrations.hf.long_context`; never its class); :meth:`close` undoes it. With
        ``tiled_loss``, ``model(**batch)`` given ``shift_labels`` (and no ``labels``) returns the sequence-group
        mean loss with this session's gradient scale, and no logits. Nothing when the section switches none on.

        Raises:
            ValueError: a model the section cannot be applied to, naming the field and the fix.
        """
        check_long_context(model, self.section.long_context)
        self._undo.append(
            apply_long_context(model, self.section.long_context, self.topology, lambda: self.gradient_scale)
        )
        if self.attention is not None:
            self.attention.long_context_applied = True

    def close(self) -> None:
        """Put back exactly the registry entries this session replaced, undo :meth:`apply_long_context` and remove
        the model hooks; a second call does nothing."""
        while self._undo:
            self._undo.pop()()

    def on_close(self, undo: Callable[[], None]) -> None:
        """Run ``undo`` at :meth:`close` (after what was added later: the last added runs first)."""
        self._undo.append(undo)

    def __enter__(self) -> SequenceParallelSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def installed_sessions() -> list[SequenceParallelSession]:
    """The sessions whose attention transformers' attention registry holds now (read off the registry itself)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    found: list[SequenceParallelSession] = []
    for entry in list(ALL_ATTENTION_FUNCTIONS._local_mapping.values()):
        session = getattr(entry, "session", None) if isinstance(entry, SequenceParallelAttention) else None
        if session is not None and all(session is not other for other in found):
            found.append(session)
    return found


def require_session(session: Any, call: str) -> SequenceParallelSession:
    """``session``, or a ``TypeError`` naming the fix when it is not the session ``register_with_transformers``
    returned (e.g. a Topology passed where the session now goes)."""
    if isinstance(session, SequenceParallelSession):
        return session
    raise TypeError(
        f"{call} takes the SequenceParallelSession that register_with_transformers returns as its first argument, "
        f"got {type(session).__name__}; write session = register_with_transformers(...) and pass session "
        f"(session.topology is the Topology)"
    )
