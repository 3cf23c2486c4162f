"""DeepSpeed ALST's names and signatures, with ALST's semantics, on ds_ring: change one import.

``from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter``
becomes ``from ds_ring.integrations.hf import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter``; ALST's calls
stay as they are. With ALST's arguments alone ds_ring does what ALST does (Ulysses, dense attention,
contiguous shards) and the returned ``mpu`` (a :class:`ds_ring.Topology`) goes to ``deepspeed.initialize``
at ZeRO 0-3; a ``ring_attention`` section in the ds_config given as ``config=`` switches strategy,
branches and layout. Both are thin: they call :func:`register_with_transformers` and
:func:`~ds_ring.integrations.hf.batches.shard_batch`. ALST's calls return the ``mpu`` where ds_ring's return the
:class:`~ds_ring.integrations.hf.session.SequenceParallelSession`: the adapter takes it as ``session=``, or finds it
in transformers' attention registry by its ``sp_group`` (what ALST's call installed there). The tiled names of
ALST's full recipe are in :mod:`.alst_tiles`.

Where ALST trains wrong without a word, ds_ring corrects or refuses: the tutorial's loss (``loss_function`` on
the shard, weighted through a differentiable all-gather) gets ``sp ×`` the gradient at ZeRO 0–2 under ALST
(DeepSpeed #5248) and the whole model's under ds_ring (:mod:`ds_ring.integrations.hf.loss`); ranks that pass
different documents (different samples sharded by hand, ``cu_seq_lens_q``) raise instead of being stitched
into one sequence; loaders of different lengths raise on every rank at once instead of waiting out the timeout.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ds_ring.integrations.hf.batches import gather_batches, shard_batch
from ds_ring.integrations.hf.documents import DOCUMENTS_KEY
from ds_ring.integrations.hf.registration import register_with_transformers
from ds_ring.integrations.hf.session import SequenceParallelSession, installed_sessions, require_session
from ds_ring.integrations.internal import SECTION, DsConfig, Topology, read_ds_config, read_section

__all__ = ["UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter"]


class UlyssesSPAttentionHF:
    """ALST's registration entry point (a namespace: ds_ring's attention function is what gets registered)."""

    @classmethod
    def register_with_transformers(
        cls,
        model_name_or_path: Any,
        core_attn_implementation: str,
        sequence_parallel_size: int,
        micro_batch_size: int,
        seq_length: int | None = None,
        seq_length_is_variable: bool = True,
        disable_in_eval: bool = False,
        max_length: int | None = None,
        *,
        config: str | os.PathLike | Mapping[str, Any] | None = None,
    ) -> Topology | None:
        """ALST's ``register_with_transformers``: ds_ring attention for ``core_attn_implementation``; the ``mpu``.

        Args:
            model_name_or_path: a model (or a wrapper with a ``config``, as PEFT's), a config, or a model
                name / local directory, read for its config only.
            core_attn_implementation: ``"sdpa"``, a flash attention, ``"flex_attention"`` or a hub kernel name.
            sequence_parallel_size: ranks sharing one sequence; 1 registers nothing and returns ``None``.
            micro_batch_size: sequences per micro-batch (checked, as ALST does; ds_ring needs no fixed size).
            seq_length: the sequence length, if fixed; must split into ``sequence_parallel_size`` shards.
            seq_length_is_variable: ``False`` requires ``seq_length`` (ALST's fixed-shape path; ds_ring plans
                per shape either way).
            disable_in_eval: ``model.eval()`` runs the original attention on whole sequences.
            max_length: ALST's deprecated name of ``seq_length``.
            config: ds_ring's addition: a whole ds_config whose ``ring_attention`` section chooses strategy,
                branches and layout (its ``sequence_parallel_size``, if set, must be this one) and whose
                ``zero_optimization`` is the engine's. ``None``: dense Ulysses, DeepSpeed's ZeRO defaults. Its
                ``long_context`` is applied to a model instance given as ``model_name_or_path``
                (:meth:`~ds_ring.integrations.hf.session.SequenceParallelSession.apply_long_context`).

        Returns:
            The :class:`ds_ring.Topology` (``None`` for ``sequence_parallel_size == 1``): pass it as
            ``deepspeed.initialize(..., mpu=mpu)``; ``deepspeed.utils.groups`` then gives its groups.

        Raises:
            ValueError: as ALST does (a fixed shape without ``seq_length``, a length that does not split,
                an implementation that does not match the model's, ``eager``) and as
                :func:`register_with_transformers` does — before any communication.
        """
        if sequence_parallel_size == 1:
            return None
        seq_length = seq_length if seq_length is not None else max_length
        for name, value in (("sequence_parallel_size", sequence_parallel_size), ("micro_batch_size", micro_batch_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not seq_length_is_variable and seq_length is None:
            raise ValueError(
                "seq_length_is_variable=False needs seq_length (the fixed sequence length of every batch); pass "
                "seq_length, or leave seq_length_is_variable=True"
            )
        if seq_length is not None and seq_length % sequence_parallel_size:
            raise ValueError(
                f"seq_length {seq_length} is not divisible by sequence_parallel_size {sequence_parallel_size}; use "
                f"a length that splits into {sequence_parallel_size} shards"
            )
        loaded = _ds_config(config, sequence_parallel_size)
        if loaded.section.long_context.enabled and not isinstance(model_name_or_path, nn.Module):
            raise ValueError(
                f"{SECTION}.long_context is applied to the model instance, and {model_name_or_path!r} is none; pass "
                f"the model as model_name_or_path (or drop {SECTION}.long_context)"
            )
        session = register_with_transformers(
            model_name_or_path,
            core_attn_implementation=core_attn_implementation,
            config=loaded,
            disable_in_eval=disable_in_eval,
        )
        if isinstance(model_name_or_path, nn.Module):
            session.apply_long_context(model_name_or_path)
        return session.topology

    @classmethod
    def unregister_from_transformers(cls, core_attn_implementation: str | None = None) -> None:
        """Put back what :meth:`register_with_transformers` replaced: close the sessions transformers' attention
        registry holds (for ``core_attn_implementation``, or every one)."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        for session in installed_sessions():
            if core_attn_implementation is None or ALL_ATTENTION_FUNCTIONS.get(core_attn_implementation) is (
                session.attention
            ):
                session.close()


def _ds_config(config: str | os.PathLike | Mapping[str, Any] | None, sequence_parallel_size: int) -> DsConfig:
    """The ds_config to register with, read by :func:`~ds_ring.config.read_section`: ``config``'s section (its
    degree checked), or ALST's dense Ulysses where ``config`` has none.

    Raises:
        ValueError: a section with another ``sequence_parallel_size``, or one with ``enabled: false`` (ALST's call
            asks for sequence parallelism).
    """
    whole = {} if config is None else read_ds_config(config)
    section = dict(whole.get(SECTION) or {"strategy": "ulysses"})
    given = section.setdefault("sequence_parallel_size", sequence_parallel_size)
    if given != sequence_parallel_size:
        raise ValueError(
            f"{SECTION}.sequence_parallel_size is {given} in the ds_config but sequence_parallel_size="
            f"{sequence_parallel_size} was passed; make them equal (or leave it out of the section)"
        )
    loaded = read_section({**whole, SECTION: section})
    if not loaded.section.enabled:
        raise ValueError(
            f"{SECTION}.enabled is false in the ds_config but sequence_parallel_size={sequence_parallel_size} was "
            f"passed; remove enabled: false, or pass sequence_parallel_size=1 (no sequence parallelism)"
        )
    return loaded


class UlyssesSPDataLoaderAdapter:
    """ALST's data loader adapter: every rank's batch runs whole, sequence-parallel, one after another.

    Each rank of a sequence-parallel group loads its own batches (e.g. a ``DistributedSampler`` over the
    world). For every batch of the wrapped loader the ranks gather one another's batch
    (:func:`~ds_ring.integrations.hf.batches.gather_batches`, any lengths), then yield, in
    sequence-parallel rank order, this rank's shard of each (:func:`shard_batch`). A yielded batch has ALST's
    keys: ``input_ids``, global ``position_ids``, ``shift_labels``, and the batch's other entries; ``labels``
    and ``attention_mask`` are consumed. ``len()`` is ALST's: the loader's length times ``sp_world_size``.
    A vision-language model's batch is yielded as :func:`shard_batch` makes it (the whole sequence and its images,
    this rank's ``shift_labels`` and the documents: the model computes the shard's positions itself).

    The documents of the whole sequence (``position_ids`` restarting at 0 mark where each begins), which a
    shard alone cannot tell, are not a key of the batch: the adapter hands them to the registered attention
    with the yielded ``position_ids`` tensor (:meth:`SequenceParallelAttention.expect_documents`), which finds
    them by that tensor when the model is called with the batch. They live as long as that tensor does, so a
    call can never read another batch's documents; a model called with position ids of no yielded batch (and
    no ``cu_seq_lens_q``) raises.

    The first exchange of each step also says whether each rank's loader has another batch: when one is
    exhausted and another is not, every rank raises at once, naming the ranks and their batch counts (ALST
    waits in its all-gather until the collective timeout).

    Args:
        dl: the loader to wrap; batches are dicts of ``[batch, seq, ...]`` tensors (non-tensors are copied).
        sp_rank, sp_group, sp_world_size: this rank's sequence-parallel rank, the group and its size
            (``deepspeed.utils.groups._get_sequence_parallel_*()`` after ``deepspeed.initialize(mpu=...)``).
        device: where the yielded tensors go.
        session: ds_ring's addition: the session of ``register_with_transformers``. Default: the session
            transformers' attention registry holds with ``sp_group`` as its sequence-parallel group (what
            :meth:`UlyssesSPAttentionHF.register_with_transformers` installed).
        pad_to_multiple: ds_ring's addition: pad a sequence that does not split into the layout's chunks (label
            -100, never attended by a counted token) rather than raise (:func:`shard_batch`).

    Raises:
        ValueError: ``sp_rank`` / ``sp_world_size`` that are not ``sp_group``'s, or no session given and none (or
            several) installed for ``sp_group`` — before any communication; while iterating, loaders of different
            lengths on the group's ranks (on every rank, at the first step where they differ).
    """

    def __init__(
        self,
        dl: Iterable[Mapping[str, Any]],
        sp_rank: int,
        sp_group: dist.ProcessGroup,
        sp_world_size: int,
        device: torch.device | str | None,
        *,
        session: SequenceParallelSession | None = None,
        pad_to_multiple: bool = False,
    ) -> None:
        session = _installed_session(sp_group) if session is None else require_session(session, "the adapter")
        if (sp_rank, sp_world_size) != (dist.get_rank(sp_group), dist.get_world_size(sp_group)):
            raise ValueError(
                f"sp_rank {sp_rank} / sp_world_size {sp_world_size} are not this rank's place in sp_group (rank "
                f"{dist.get_rank(sp_group)} of {dist.get_world_size(sp_group)}); pass "
                f"groups._get_sequence_parallel_rank() and groups._get_sequence_parallel_world_size()"
            )
        self.dl, self.sp_rank, self.sp_group, self.sp_world_size = dl, sp_rank, sp_group, sp_world_size
        self.device, self.session, self.pad_to_multiple = device, session, pad_to_multiple

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self) -> Iterator[dict[str, Any]]:
        attention, loaded = self.session.attention, iter(self.dl)
        for step in itertools.count():
            gathered = gather_batches(next(loaded, None), self.session.topology, batches_before=step)
            if gathered is None:
                return
            for batch in gathered:
                sharded = shard_batch(self.session, batch, check_same=False, pad_to_multiple=self.pad_to_multiple)
                if self.session.vision is not None:  # the whole sequence: the model makes the shard's positions
                    yield {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in sharded.items()}
                    continue
                documents = sharded.pop(DOCUMENTS_KEY)
                del sharded["cu_seq_lens_q"], sharded["cu_seq_lens_k"]
                out = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in sharded.items()}
                if attention is not None:
                    attention.expect_documents(out["position_ids"], documents)
                yield out


def _installed_session(group: dist.ProcessGroup) -> SequenceParallelSession:
    """The one session transformers' attention registry holds whose sequence-parallel group is ``group``."""
    found = [s for s in installed_sessions() if s.topology.sequence_parallel_group is group]
    if len(found) != 1:
        raise ValueError(
            f"UlyssesSPDataLoaderAdapter: {len(found) or 'no'} ds_ring registration(s) installed in transformers have "
            f"sp_group as their sequence-parallel group; call UlyssesSPAttentionHF.register_with_transformers first "
            f"and pass its mpu's group, or pass session= (what register_with_transformers returns)"
        )
    return found[0]
