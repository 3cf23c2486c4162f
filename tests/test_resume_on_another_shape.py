"""A checkpoint written at one shape resumes at another and, one step later, holds what an uninterrupted run holds.

The main job (launch/train.py under torchrun, CPU, dense causal attention over 128 tokens, a 1-layer model of
dim 32, lr 1e-5) runs 9 steps on 4 ranks (sequence parallel 4) saving at step 8: the reference, and the step-8
checkpoint the cases resume from, in place and without saving: a universal form one case converts is reused by
the next case resuming from it (checked: ``converted in 0.00 s``), so each checkpoint is converted once. Each case
resumes at another shape for ONE step (to step 9) and its final state must equal the reference's: the optimizer's
fp32 master weights, the model's weights (in the run's dtype), the Adam moments, the Adam step and, in fp16, the
loss scale (``launch/train.py --final-optimizer-state``). One step, not several: bf16 runs at 4 and 2 ranks drift
apart by up to lr per step from the same state.

Tolerances (Adam β1 = 0.9, β2 = 0.999, no weight decay; u = the dtype's unit roundoff: fp32 2^-24, bf16 2^-8,
fp16 2^-11). Both runs take step 9 from the same state (what the checkpoint holds) on the same samples; only the
split of the sums over ranks differs, so step 9's gradients differ by rounding:

- fp32 master weights: Adam's step t moves a parameter by lr·|m̂/√v̂| ≤ B(t)·lr whatever the gradients
  (:func:`adam_step_bound`, Cauchy–Schwarz: B(9) = 1.035, B(10) = 1.043 for DeepSpeed's fp16 optimizer, whose
  Adam counts one more step), so the runs differ by at most 2·B(t)·lr ≈ 2.1e-5, in every dtype. Not looser:
  attention's key biases have zero gradient in exact arithmetic (softmax is invariant to a constant per query), so
  Adam turns rounding noise into updates of up to lr, of either sign. The checkpoint is taken at step 8 so that a
  master copy lost across the reshape shows: the masters start as the bf16/fp16 weights and move ~lr per step, so
  masters rebuilt from the half-precision weights are off by up to ~8·lr: measured 3.5 (bf16) and 2.9 (fp16) times
  the bound (at step 2 it did not show).
- the model's weights (the master rounded to the run's dtype): the same plus one rounding of each run,
  2·B(t)·lr + 2u·max|p| (bf16: 2^-7 of the largest parameter).
- Adam moments: they differ by (1−β1)·Δg and ≈2(1−β2)|g|·Δg, Δg being the rounding difference of step 9's
  gradients; measured at a few u of the largest moment (bf16 ~1e-2), they are checked at 16u of the model's
  largest moment (fp32: at least 1e-5). Moments lost across the reshape (restarted from zero) would be off by most
  of the largest (measured 0.76 and 0.88 in bf16: exp_avg ≈ (1−β1⁹)g with its history, (1−β1)g without).
- the Adam step and the fp16 loss scale: exactly. fp16 runs with ``initial_scale_power`` 4 and
  ``loss_scale_window`` 1, so the scale doubles after every step but the first: 2^11 at the checkpoint, 2^12 one step
  later (a scaler restarted at 2^4 reaches at most 2^5).

Cases, fp32 (ZeRO partitions over every rank either way: native where DeepSpeed loads it as it is):

- 4 → 2 ranks (sequence parallel 4 → 2), ZeRO 2: converted to a universal checkpoint;
- 2 → 4 ranks and ZeRO 2 → 3 on 2 ranks: one 2-rank ZeRO-2 run's step-8 checkpoint (the ZeRO-3 loader reads the
  optimizer-state entry ds_ring adds to a ZeRO 1-2 conversion);
- ZeRO 3 → 2 on 4 ranks and ZeRO 3 on 2 → 4 ranks: one 2-rank ZeRO-3 run's step-8 checkpoint (the ZeRO 1-2 loader
  reads the step, version and parameter shapes ds_ring adds to a ZeRO-3 conversion);
- data parallel 1 → 2 on 4 ranks (sequence parallel 2), the global batch kept (micro-batch 4 → 2): loaded as it is.

Half precision, 4 → 2 ranks (bf16: DeepSpeed's bf16 optimizer; fp16: its fp16 optimizer and dynamic loss scaler;
at ZeRO 0 each keeps a whole fp32 copy, loaded as it is; at ZeRO 1-3 through the universal checkpoint):

- bf16 and fp16 at ZeRO 0 and ZeRO 2, each against its own uninterrupted run;
- bf16 ZeRO 2 → 3 and fp16 ZeRO 2 → 1, against the ZeRO-2 run;
- bf16 at ZeRO 1 with fp32 gradient accumulation (DeepSpeed's ``BF16_Optimizer``, masters partitioned).

fp16 runs through ``tests/cpu_fp16_train.py`` (DeepSpeed refuses fp16 on this CPU; torch computes it). And a
shape that cannot be resumed (ZeRO 0 → 2) is refused before the first step, naming both shapes (the bf16 ZeRO-0
checkpoint). 22 launches of 2-4 ranks, 6 universal conversions; marked slow.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.trainer_runs import BIN, ROOT, TRAIN, Exit, free_port, reap, run_command, write_config

pytestmark = pytest.mark.slow
STEPS, SAVED = 9, 8
LR = 1e-5
SEQ = 128
MODEL = ["--dim", "32", "--heads", "2", "--kv-heads", "1", "--layers", "1"]
FP16_TRAIN = str(ROOT / "tests" / "cpu_fp16_train.py")
FP16 = {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 1}
UNIT_ROUNDOFF = {"fp32": 2.0**-24, "bf16": 2.0**-8, "fp16": 2.0**-11}
MOMENT_FLOOR = 1e-5  # fp32's moment tolerance floor, relative to the largest moment


def adam_step_bound(t: int, beta1: float = 0.9, beta2: float = 0.999) -> float:
    """The largest ``|m̂/√v̂|`` of Adam's step ``t`` over all gradients ``g_1..g_t``: with ``m̂ = Σ a_i g_i`` and
    ``v̂ = Σ c_i g_i²`` (``a_i = (1−β1)β1^(t−i)/(1−β1^t)``, ``c_i = (1−β2)β2^(t−i)/(1−β2^t)``), Cauchy–Schwarz gives
    ``|m̂| ≤ √(Σ a_i²/c_i)·√v̂``, attained by some gradients. 1.0036 at t = 3, 1.035 at t = 9."""
    a = [(1 - beta1) * beta1 ** (t - i) / (1 - beta1**t) for i in range(1, t + 1)]
    c = [(1 - beta2) * beta2 ** (t - i) / (1 - beta2**t) for i in range(1, t + 1)]
    return sum(x * x / y for x, y in zip(a, c, strict=True)) ** 0.5


def _train(run: Path, *, ranks: int, zero: int, precision: str = "fp32", sequence_parallel: int | None = None,
           micro: int = 4, steps: int = STEPS, save_every: int = 0, resume: Path | None = None,
           config_extra: dict | None = None) -> Exit:  # fmt: skip
    """``torchrun`` of the main job on ``ranks`` ranks into ``run`` (``run/final.pt``, ``run/state.pt``),
    checkpointing into ``run/ckpt`` or resuming from ``resume``'s (without saving: a universal form converted there
    is reused by the next case resuming from it), ``config_extra`` added to the ds_config; asserts that nothing it
    started is left running."""
    config = write_config(run / f"ds_config_{ranks}.json", sequence_parallel=sequence_parallel or ranks, dense=True,
                          zero_stage=zero, micro_batch=micro, metrics=False)  # fmt: skip
    extra = {**({} if precision == "fp32" else {precision: FP16 if precision == "fp16" else {"enabled": True}}),
             **(config_extra or {})}  # fmt: skip
    config.write_text(json.dumps({**json.loads(config.read_text()), **extra}))
    args = ["--deepspeed_config", str(config), "--seq", str(SEQ), "--steps", str(steps), "--save-every",
            str(save_every), "--save-dir", str((resume or run) / "ckpt"), "--final-params", str(run / "final.pt"),
            "--final-optimizer-state", str(run / "state.pt"), "--lr", str(LR), *MODEL]  # fmt: skip
    port = free_port()
    command = [str(BIN / "torchrun"), "--nnodes", "1", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
               "--master-port", str(port), FP16_TRAIN if precision == "fp16" else TRAIN, *args]  # fmt: skip
    try:
        return run_command(command, port, run / f"torchrun_{ranks}.log", timeout=400)
    finally:
        left = reap(str(run))
        assert left == [], f"processes left running: {left}"


def _universal(run: Path) -> Path:
    """Where a resume from ``run``'s step-8 checkpoint converts it to (or finds) the universal form."""
    return run / "ckpt" / f"step{SAVED}_universal"


def _ended(run: Path, done: Exit) -> dict:
    assert done.code == 0, done.output[-4000:]
    return {"weights": torch.load(run / "final.pt"), **torch.load(run / "state.pt")}


def _differences(expected: dict, got: dict) -> dict[str, float]:
    """The largest difference of each kind of state, relative to its largest value in ``expected``."""
    params = expected["params"]
    kinds = {"weights": (expected["weights"], got["weights"])}
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        kinds[key] = ({n: v[key] for n, v in params.items()}, {n: v[key] for n, v in got["params"].items()})
    found = {}
    for kind, (want, have) in kinds.items():
        assert want.keys() == have.keys(), (kind, sorted(want.keys() ^ have.keys()))
        largest = max(v.float().abs().max().item() for v in want.values())
        found[kind] = max((want[n].float() - have[n].float()).abs().max().item() for n in want) / largest
    return found


def _assert_resumed(expected: dict, run: Path, done: Exit, loaded_as: str, precision: str = "fp32",
                    case: str = "") -> dict:  # fmt: skip
    """The resumed run ``run`` (of ``case``, named in the printed differences) ended with ``expected``'s state
    (tolerances: the module docstring); returns the differences relative to the largest value of each kind."""
    assert f"resumed from checkpoint step{SAVED} at step {SAVED} ({loaded_as}" in done.output, done.output[-4000:]
    got = _ended(run, done)
    assert got["steps"] == expected["steps"], (got["steps"], expected["steps"])
    assert got["loss_scale"] == expected["loss_scale"], (got["loss_scale"], expected["loss_scale"])
    largest = max(v["fp32"].abs().max().item() for v in expected["params"].values())
    master = 2 * adam_step_bound(max(expected["steps"])) * LR / largest
    u = UNIT_ROUNDOFF[precision]
    tolerances = {"fp32": master, "weights": master + 2 * u,
                  "exp_avg": max(16 * u, MOMENT_FLOOR), "exp_avg_sq": max(16 * u, MOMENT_FLOOR)}  # fmt: skip
    found = _differences(expected, got)
    print(f"{case or run.name}: {precision}, max difference / largest value: "
          + ", ".join(f"{kind} {value:.2e}" for kind, value in found.items()))  # fmt: skip
    beyond = {kind: (found[kind], tolerances[kind]) for kind in found if found[kind] > tolerances[kind]}
    assert not beyond, f"(difference, tolerance) relative to the largest value: {beyond}"
    return found


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The fp32 ZeRO-2 run on 4 ranks (sequence parallel 4): its directory and final state."""
    run = tmp_path_factory.mktemp("reference")
    done = _train(run, ranks=4, zero=2, save_every=SAVED)
    marker = json.loads((run / "ckpt" / f"step{SAVED}" / "ds_ring_complete.json").read_text())
    assert marker["shape"] == dict(world_size=4, data_parallel=1, sequence_parallel=4, zero_stage=2, global_batch=4)
    return run, _ended(run, done)


@pytest.fixture(scope="module")
def two_rank_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """ZeRO stage → a 2-rank fp32 run (sequence parallel 2) that saved step 8: each shared by two cases, lazily."""
    runs: dict[int, Path] = {}

    def at(zero: int) -> Path:
        if zero not in runs:
            run = tmp_path_factory.mktemp(f"two_ranks_zero{zero}")
            first = _train(run, ranks=2, zero=zero, steps=SAVED, save_every=SAVED)
            assert first.code == 0, first.output[-4000:]
            runs[zero] = run
        return runs[zero]

    return at


@pytest.fixture(scope="module")
def half_references(tmp_path_factory: pytest.TempPathFactory):
    """(precision, ZeRO stage) → its uninterrupted 4-rank run saving step 8: directory and final state, lazily."""
    runs: dict[tuple[str, int], tuple[Path, dict]] = {}

    def of(precision: str, zero: int) -> tuple[Path, dict]:
        if (precision, zero) not in runs:
            run = tmp_path_factory.mktemp(f"{precision}_zero{zero}")
            runs[precision, zero] = run, _ended(run, _train(run, ranks=4, zero=zero, precision=precision,
                                                            save_every=SAVED))  # fmt: skip
        return runs[precision, zero]

    return of


@pytest.mark.timeout(900)
def test_four_ranks_to_two(reference, tmp_path: Path) -> None:
    source, expected = reference
    done = _train(tmp_path, ranks=2, zero=2, resume=source)
    _assert_resumed(expected, tmp_path, done, "universal", case="4 -> 2 ranks, ZeRO 2")
    assert "written at (4 ranks = 1 data-parallel × 4 sequence-parallel, ZeRO 2" in done.output
    assert (_universal(source) / "zero").is_dir()


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("first_zero", "ranks", "zero", "converted"),
    [(2, 4, 2, False), (2, 2, 3, True), (3, 4, 2, True), (3, 4, 3, False)],
    ids=["two_ranks_to_four", "zero2_to_zero3", "zero3_to_zero2", "zero3_two_ranks_to_four"],
)
def test_two_rank_checkpoint_resumes(
    reference, two_rank_checkpoints, tmp_path: Path, first_zero: int, ranks: int, zero: int, converted: bool
) -> None:
    """A 2-rank run's step-8 checkpoint at ZeRO ``first_zero`` resumed on ``ranks`` ranks (all sequence parallel)
    at ZeRO ``zero``; ``converted``: the ZeRO stage changes, so the log names the shape it was converted for."""
    _, expected = reference
    source = two_rank_checkpoints(first_zero)
    reused = _universal(source).is_dir()
    done = _train(tmp_path, ranks=ranks, zero=zero, resume=source)
    case = f"2 ranks ZeRO {first_zero} -> {ranks} ranks ZeRO {zero}"
    _assert_resumed(expected, tmp_path, done, "universal", case=case)
    assert not reused or "(universal: converted in 0.00 s" in done.output, "the universal form was not reused"
    shape = f"{ranks} ranks = 1 data-parallel × {ranks} sequence-parallel, ZeRO {zero}, global batch 4"
    assert not converted or f"at ({shape}): converted" in done.output


@pytest.mark.timeout(900)
def test_data_parallel_change_keeps_the_global_batch(reference, tmp_path: Path) -> None:
    source, expected = reference
    done = _train(tmp_path, ranks=4, sequence_parallel=2, zero=2, micro=2, resume=source)
    _assert_resumed(expected, tmp_path, done, "native", case="4 ranks: data parallel 1 -> 2")
    assert "global batch changes" not in done.output


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("precision", "saved_zero", "zero", "loaded_as"),
    [("bf16", 0, 0, "native"), ("bf16", 2, 2, "universal"), ("fp16", 0, 0, "native"), ("fp16", 2, 2, "universal"),
     ("bf16", 2, 3, "universal"), ("fp16", 2, 1, "universal")],
    ids=["bf16_zero0", "bf16_zero2", "fp16_zero0", "fp16_zero2", "bf16_zero2_to_zero3", "fp16_zero2_to_zero1"],
)  # fmt: skip
def test_half_precision_four_ranks_to_two(
    half_references, tmp_path: Path, precision: str, saved_zero: int, zero: int, loaded_as: str
) -> None:
    """4 ranks at ZeRO ``saved_zero`` → checkpoint → 2 ranks at ZeRO ``zero``, in ``precision``: one step later
    equal to the uninterrupted 4-rank run (the fp32 master copy, the moments, the step and fp16's loss scale
    survive the reshape)."""
    source, expected = half_references(precision, saved_zero)
    if precision == "fp16":  # doubled after every step but the first; a scaler restarted at 2^4 stays below 2^6
        assert expected["loss_scale"] >= 2.0 ** (FP16["initial_scale_power"] + 2), expected["loss_scale"]
    reused = _universal(source).is_dir()
    done = _train(tmp_path, ranks=2, zero=zero, precision=precision, resume=source)
    case = f"4 ranks ZeRO {saved_zero} -> 2 ranks ZeRO {zero}"
    _assert_resumed(expected, tmp_path, done, loaded_as, precision, case)
    assert not reused or "(universal: converted in 0.00 s" in done.output, "the universal form was not reused"


@pytest.mark.timeout(900)
def test_bf16_optimizer_four_ranks_to_two(tmp_path: Path) -> None:
    """bf16 at ZeRO 1 with fp32 gradient accumulation, where DeepSpeed steps its ``BF16_Optimizer`` (fp32 masters
    partitioned over every rank, ``bf16_zero_pp_rank_*`` files): 4 ranks → checkpoint → 2 ranks through the
    universal checkpoint, one step later equal to the uninterrupted run."""
    accumulate = {"data_types": {"grad_accum_dtype": "fp32"}}
    source, run = tmp_path / "uninterrupted", tmp_path / "resumed"
    source.mkdir(), run.mkdir()
    expected = _ended(source, _train(source, ranks=4, zero=1, precision="bf16", save_every=SAVED,
                                     config_extra=accumulate))  # fmt: skip
    state = torch.load(next((source / "ckpt" / f"step{SAVED}").glob("bf16_zero_pp_rank_0_*")), weights_only=False)
    assert "single_partition_of_fp32_groups" in state["optimizer_state_dict"], "not DeepSpeed's BF16_Optimizer"
    assert "zero_stage" not in state["optimizer_state_dict"], "not DeepSpeed's BF16_Optimizer"
    done = _train(run, ranks=2, zero=1, precision="bf16", resume=source, config_extra=accumulate)
    _assert_resumed(expected, run, done, "universal", "bf16", "BF16_Optimizer, ZeRO 1, 4 -> 2 ranks")


@pytest.mark.timeout(900)
def test_zero0_to_zero2_is_refused_before_the_first_step(half_references, tmp_path: Path) -> None:
    source, _ = half_references("bf16", 0)
    done = _train(tmp_path, ranks=2, zero=2, precision="bf16", resume=source)
    assert done.code not in (0, None), done.output[-4000:]
    written = "4 ranks = 1 data-parallel × 4 sequence-parallel, ZeRO 0, global batch 4"
    now = "2 ranks = 1 data-parallel × 2 sequence-parallel, ZeRO 2"
    assert f"written at ({written}) and cannot be resumed at ({now}" in done.output, done.output[-4000:]
    assert "train:" not in done.output.split("cannot be resumed")[1], "a step ran after the refusal"
