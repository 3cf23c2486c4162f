"""``SequenceParallelTrainer``'s batches in a GPU job's configuration: ``TrainingArguments`` without ``use_cpu``, and
a ``datasets.Dataset`` as well as a list.

Without ``use_cpu`` on a CPU, accelerate finds no device backend and counts one process while DeepSpeed starts the
process group over every rank; ``SequenceParallelTrainer`` then takes the arguments with ``use_cpu=True`` (the job runs
on the CPU either way), so that accelerate counts every rank, as on a GPU. The Trainer's loaders split the batches over
the topology's data-parallel replicas whatever accelerate counts. On gloo ranks (the tiny fp32 Llama and SGD of
``test_hf_trainer.py``), 3 optimizer steps equal the README's hand-written loop at 2 ranks (ZeRO 2: a list, a
``datasets.Dataset`` of the same rows) and at 2 data × 2 sequence-parallel ranks (each replica its own batches: a
list, a ``datasets.Dataset``), all with ``use_cpu`` unset; the tokens logged count each sequence once.
"""

from __future__ import annotations

import os
import tempfile

import pytest

from tests.dist import CaseLog, assert_no_failures, run_distributed
from tests.test_hf_trainer import BATCH, STEPS, _assert_parameters, _ds_config, _hand_written, _parameters, _samples
from tests.test_hf_trainer import _trainer as _make_trainer


def _as_dataset(data: list[dict]):
    """The same rows as a ``datasets.Dataset`` (int lists: the default collator stacks them as the list's tensors).

    Built from its Arrow table with a fingerprint given: ``Dataset.from_list`` hashes the table with dill, which fails
    on pyarrow's ``MonthDayNano`` type with the releases CI installs (datasets 5.2, pyarrow 26, Python 3.11)."""
    import datasets  # the dev extra's
    import pyarrow as pa
    from datasets.table import InMemoryTable

    columns = {key: [row[key].tolist() for row in data] for key in data[0]}
    return datasets.Dataset(InMemoryTable(pa.table(columns)), fingerprint=f"ds-ring-trainer-{len(data)}")


def _rank(rank: int, world: int) -> list[str]:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    log = CaseLog()
    shape = "2 sequence-parallel ranks" if world == 2 else "2 data x 2 sequence-parallel ranks"
    with tempfile.TemporaryDirectory() as output:
        for kind in ("list", "datasets.Dataset"):
            with log.case(f"use_cpu unset, {shape}, a {kind}: 3 steps = the hand-written loop"):
                config = _ds_config(2)
                samples = STEPS * BATCH * (world // 2)
                data = _samples(samples + BATCH)
                trainer = _make_trainer(config, data if kind == "list" else _as_dataset(data), False, output,
                                        use_cpu=False)  # fmt: skip
                try:
                    assert trainer.args.world_size == world, (trainer.args.world_size, trainer.args.use_cpu)
                    trainer.train()
                    got = _parameters(trainer.model_wrapped)
                    seen = trainer.state.num_input_tokens_seen
                finally:
                    trainer.close()
                assert seen == sum(len(sample["input_ids"]) for sample in data[:samples]), seen
                _assert_parameters(got, _hand_written(config, data, False))
    return log.failures


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks: CI's second step (time)
def test_trainer_batches_without_use_cpu(world: int) -> None:
    assert_no_failures(run_distributed(_rank, world, timeout=360))
