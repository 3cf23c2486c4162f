"""Hugging Face transformers models, sequence-parallel through ds_ring (a drop-in for DeepSpeed's ALST).

DeepSpeed's ALST (``deepspeed.runtime.sequence_parallel.ulysses_sp``) overwrites transformers'
attention registry entry with a Ulysses wrapper and shards the data loader's batches; it offers
Ulysses only, dense only. This package plugs into the same place with every ds_ring strategy
(``ring``, ``allgather``, ``ulysses``, ``hybrid``), dense or LongNet-dilated, chosen by the
ds_config's ``ring_attention`` section::

    from ds_ring.integrations.hf import SequenceParallelDataLoader, causal_lm_loss, register_with_transformers

    engine, *_ = ds_ring.initialize(model=model, optimizer=optimizer, config="ds_config.json")
    with register_with_transformers(model, config="ds_config.json", topology=engine.mpu) as session:
        session.apply_long_context(model)                           # the section's long_context, if any
        for batch in SequenceParallelDataLoader(loader, session):  # full batches in, this rank's shards out
            loss = causal_lm_loss(session, engine(**batch).logits, batch["shift_labels"])
            engine.backward(loss)
            engine.step()

The :class:`~.session.SequenceParallelSession` that registration returns is what every later call takes: its
section, topology (``session.topology``, the ``mpu``) and the engine's gradient scale; closing it (the ``with``
block, or ``session.close()``) puts transformers' registries and the model back.

Every rank of a sequence-parallel group must load the same full batches (a sampler over the
data-parallel replicas: ``session.topology.get_data_parallel_world_size()`` / ``get_data_parallel_rank()``).
Gradients follow ds_ring's contract: each rank's gradient is its tokens' share, and the sum over the
sequence group (what ZeRO's reduction does) is the whole model's gradient.

The package is laid out by job: :mod:`.session` (the handle every call takes), :mod:`.registration` (what goes
into transformers' registries),
:mod:`.attention` (what runs inside the model), :mod:`.batches` and :mod:`.documents` (what prepares
batches), :mod:`.loss`, :mod:`.long_context` (the section's ``long_context`` applied to the model: tiled loss
and MLP, offloaded checkpoints), and :mod:`.alst` / :mod:`.alst_tiles`: DeepSpeed ALST's names
(``UlyssesSPAttentionHF``, ``UlyssesSPDataLoaderAdapter``, and its full recipe's ``TiledMLP``, ``TiledFusedLogitsLoss``,
``sequence_tiled_compute``) with ALST's semantics, so an ALST user changes one import.
transformers is imported on first use (``pip install ds_ring[hf]``).
"""

from ds_ring.integrations.hf.accelerate_sp import apply_to_accelerate
from ds_ring.integrations.hf.alst import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
from ds_ring.integrations.hf.alst_tiles import TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute
from ds_ring.integrations.hf.batches import SequenceParallelDataLoader, shard_batch
from ds_ring.integrations.hf.loss import causal_lm_loss
from ds_ring.integrations.hf.registration import register_with_transformers, unregister_from_transformers
from ds_ring.integrations.hf.session import SequenceParallelSession

__all__ = [
    "apply_to_accelerate",
    "SequenceParallelTrainer",
    "SequenceParallelSession",
    "register_with_transformers",
    "unregister_from_transformers",
    "shard_batch",
    "SequenceParallelDataLoader",
    "causal_lm_loss",
    "UlyssesSPAttentionHF",
    "UlyssesSPDataLoaderAdapter",
    "TiledMLP",
    "TiledFusedLogitsLoss",
    "sequence_tiled_compute",
]


def __getattr__(name: str) -> object:
    if name == "SequenceParallelTrainer":  # imports transformers' Trainer (and accelerate): only when asked for
        from ds_ring.integrations.hf.trainer import SequenceParallelTrainer

        return SequenceParallelTrainer
    raise AttributeError(f"module 'ds_ring.integrations.hf' has no attribute {name!r}")
