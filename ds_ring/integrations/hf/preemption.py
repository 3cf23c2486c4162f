"""Preemption for the Trainer: on SIGTERM / SIGUSR1 the ranks stop after the same step and transformers saves it.

The callback polls :meth:`ds_ring.engine.preemption.Preemption.stop_requested` at the end of every optimizer step;
once true it asks the Trainer for a save (its own ``checkpoint-<step>``, through transformers' save path) and
for the end of training, so ``trainer.train()`` returns and the script exits 0. ``resume_from_checkpoint=True``
then continues from it.

The Trainer cannot abandon a step in flight (transformers' checkpoint is written with collectives, and its
engine's update is not fenced: docs/elastic.md), so a step longer than the grace period is named once in a
warning (:meth:`ds_ring.engine.preemption.Preemption.stop_requested`).
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from ds_ring.integrations.internal import Preemption

__all__ = ["StopOnPreemption"]


class StopOnPreemption(TrainerCallback):
    """A ``TrainerCallback`` that saves and stops training once ``preemption`` says every rank must stop."""

    def __init__(self, preemption: Preemption) -> None:
        self.preemption = preemption
        preemption.uncovered_fix = (
            "the Trainer saves only at the end of a step (docs/elastic.md); train with ds_ring.initialize and a loop "
            "that runs each step in engine.preemption.step_in_flight (launch/train_hf.py), or save more often "
            "(save_steps)"
        )

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.preemption.stop_requested(state.global_step):
            control.should_save = True
            control.should_training_stop = True
        return control
