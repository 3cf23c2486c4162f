"""A checkpoint written at one shape resumes at another and ends where an uninterrupted run ends.

The main job (launch/train.py under torchrun, CPU, fp32, dense causal attention over 256 tokens) runs
6 steps on 4 ranks (sequence parallel 4, ZeRO 2), saving at step 3: the reference, and the step-3
checkpoint every case resumes from (a copy each). Each case resumes at another shape to step 6 and
its final parameters must equal the reference's (fp32 tolerance: another sequence split reorders sums;
the attention key biases get a looser one: their gradient is zero in exact arithmetic, softmax being
invariant to a constant per query, so Adam normalises rounding noise into updates of up to lr per step):

- 4 → 2 ranks (sequence parallel 4 → 2), ZeRO 2: converted to a universal checkpoint;
- 2 → 4 ranks: a 2-rank run's step-3 checkpoint resumed on 4;
- ZeRO 2 → 3 on 2 ranks: a 2-rank ZeRO-2 run's step-3 checkpoint resumed at ZeRO 3 (universal, completed with
  the optimizer-state entry DeepSpeed's ZeRO-3 loader reads);
- ZeRO 3 → 2 and 2 → 4 ranks: a 2-rank ZeRO-3 run's step-3 checkpoint resumed at ZeRO 2 on 4 ranks (completed with
  the step, version and parameter shapes DeepSpeed's ZeRO 1-2 loader reads);
- ZeRO 3, 2 → 4 ranks;
- data parallel 1 → 2 on 4 ranks (sequence parallel 2), the global batch kept (micro-batch 4 → 2):
  DeepSpeed loads it as it is (ZeRO partitions over all 4 ranks either way).

And a shape that cannot be resumed (ZeRO 0 → 2) is refused before the first step, naming both shapes.
About 6 minutes on 2 shared cores (13 launches of 2-4 ranks; each case 30-70 s): marked slow.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.trainer_runs import Exit, torchrun_reaped, write_config

pytestmark = pytest.mark.slow
STEPS, SAVED = 6, 3
TOLERANCE = dict(rtol=1e-3, atol=1e-4)
LR = 3e-3  # launch/train.py's default
KEY_BIAS_TOLERANCE = dict(rtol=0.0, atol=STEPS * LR)


def _train(run: Path, *, ranks: int, sequence_parallel: int, zero: int, micro: int = 4, steps: int = STEPS,
           save_every: int = 0) -> Exit:  # fmt: skip
    config = write_config(run / f"ds_config_{ranks}.json", sequence_parallel=sequence_parallel, dense=True,
                          zero_stage=zero, micro_batch=micro, metrics=False)  # fmt: skip
    args = ["--deepspeed_config", str(config), "--seq", "256", "--steps", str(steps), "--save-every", str(save_every),
            "--save-dir", str(run / "ckpt"), "--final-params", str(run / "final.pt")]  # fmt: skip
    return torchrun_reaped(args, run, run / f"torchrun_{ranks}.log", timeout=400, nproc=ranks)


def _from_step3(source: Path, run: Path) -> Path:
    """``run/ckpt`` holding a copy of ``source``'s step-3 checkpoint as its latest."""
    (run / "ckpt").mkdir(parents=True)
    shutil.copytree(source / "ckpt" / f"step{SAVED}", run / "ckpt" / f"step{SAVED}")
    (run / "ckpt" / "latest").write_text(f"step{SAVED}")
    return run


def _assert_equal_to(reference: dict[str, torch.Tensor], run: Path, done: Exit, loaded_as: str) -> None:
    assert done.code == 0, done.output[-4000:]
    assert f"resumed from checkpoint step{SAVED} at step {SAVED} ({loaded_as}" in done.output, done.output[-4000:]
    final = torch.load(run / "final.pt")
    assert final.keys() == reference.keys()
    for name, value in final.items():
        tolerance = KEY_BIAS_TOLERANCE if name.endswith("k_proj.bias") else TOLERANCE
        torch.testing.assert_close(value, reference[name], **tolerance, msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    run = tmp_path_factory.mktemp("reference")
    done = _train(run, ranks=4, sequence_parallel=4, zero=2, save_every=SAVED)
    assert done.code == 0, done.output[-4000:]
    marker = json.loads((run / "ckpt" / f"step{SAVED}" / "ds_ring_complete.json").read_text())
    assert marker["shape"] == dict(world_size=4, data_parallel=1, sequence_parallel=4, zero_stage=2, global_batch=4)
    return run, torch.load(run / "final.pt")


@pytest.mark.timeout(600)
def test_four_ranks_to_two(reference, tmp_path: Path) -> None:
    source, expected = reference
    run = _from_step3(source, tmp_path)
    done = _train(run, ranks=2, sequence_parallel=2, zero=2)
    _assert_equal_to(expected, run, done, "universal")
    assert "written at (4 ranks = 1 data-parallel × 4 sequence-parallel, ZeRO 2" in done.output
    assert (run / "ckpt" / f"step{SAVED}_universal" / "zero").is_dir()


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("first_zero", "ranks", "zero", "converted"),
    [(2, 4, 2, False), (2, 2, 3, True), (3, 4, 2, True), (3, 4, 3, False)],
    ids=["two_ranks_to_four", "zero2_to_zero3", "zero3_to_zero2", "zero3_two_ranks_to_four"],
)
def test_two_rank_checkpoint_resumes(
    reference, tmp_path: Path, first_zero: int, ranks: int, zero: int, converted: bool
) -> None:
    """A 2-rank run's step-3 checkpoint at ZeRO ``first_zero`` resumed on ``ranks`` ranks (all sequence parallel)
    at ZeRO ``zero``; ``converted``: the ZeRO stage changes, so the log names the shape it was converted for."""
    _, expected = reference
    first = _train(tmp_path, ranks=2, sequence_parallel=2, zero=first_zero, steps=SAVED, save_every=SAVED)
    assert first.code == 0, first.output[-4000:]
    done = _train(tmp_path, ranks=ranks, sequence_parallel=ranks, zero=zero)
    _assert_equal_to(expected, tmp_path, done, "universal")
    shape = f"{ranks} ranks = 1 data-parallel × {ranks} sequence-parallel, ZeRO {zero}, global batch 4"
    assert not converted or f"at ({shape}): converted" in done.output


@pytest.mark.timeout(600)
def test_data_parallel_change_keeps_the_global_batch(reference, tmp_path: Path) -> None:
    source, expected = reference
    run = _from_step3(source, tmp_path)
    done = _train(run, ranks=4, sequence_parallel=2, zero=2, micro=2)
    _assert_equal_to(expected, run, done, "native")
    assert "global batch changes" not in done.output


@pytest.mark.timeout(600)
def test_zero0_to_zero2_is_refused_before_the_first_step(tmp_path: Path) -> None:
    first = _train(tmp_path, ranks=2, sequence_parallel=2, zero=0, steps=1, save_every=1)
    assert first.code == 0, first.output[-4000:]
    done = _train(tmp_path, ranks=2, sequence_parallel=2, zero=2)
    assert done.code not in (0, None), done.output[-4000:]
    shape = "2 ranks = 1 data-parallel × 2 sequence-parallel, ZeRO {}"
    refusal = f"written at ({shape.format(0)}, global batch 4) and cannot be resumed at ({shape.format(2)}"
    assert refusal in done.output, done.output[-4000:]
    assert "train:" not in done.output.split("cannot be resumed")[1], "a step ran after the refusal"
