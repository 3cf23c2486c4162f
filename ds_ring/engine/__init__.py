"""DeepSpeed glue: ``ds_ring.initialize``, checkpoints a kill cannot corrupt, ZeRO's gradient scale and gathers,
preemption, launch environments, JIT-op build locks, and the one module that patches libraries."""
