"""transformers' ``Trainer`` and TRL's ``SFTTrainer`` under accelerate's sequence parallelism, run by ds_ring.

``launch/train_sft.py`` is a user's script plus ``apply_to_accelerate()``: 2 CPU ranks, a tiny fp32 Llama with 3
heads (2 Ulysses ranks cannot split them: ALST refuses the model), SGD at a constant learning rate, no clipping,
ZeRO 2, batches in order. Sequence parallelism is asked for as accelerate documents it: ``parallelism_config`` in the
accelerate config under ``accelerate launch`` (``launch/accelerate_sp.yaml``), or in ``TrainingArguments`` under
``torchrun``; the strategy comes from the ds_config's section (``ds_configs/sft_ring.json``, ``sft_hybrid.json``).

- the parameters after 3 steps equal one process's (the same script with ``--reference``: no DeepSpeed, no sequence
  parallelism) to fp32 tolerance: the Trainer over prompt-completion rows (labels -100 over the prompt, lengths that
  do not split in 2), SFTTrainer with packing (TRL's padding-free batches) and ``completion_only_loss``; ring and
  hybrid, each launcher, each trainer, the whole model and a LoRA adapter (PEFT's ``get_peft_model``; TRL's
  ``peft_config=``);
- a LoRA adapter at ZeRO 0, 1, 2 and 3;
- gradient accumulation (2 micro-batches per step): the loss normalised by the tokens of the whole window, as one
  process normalises it; ``evaluate()`` after training gives one process's held-out loss;
- without a ``ring_attention`` section the run is DeepSpeed's ALST, unchanged (a model with 4 heads): the Trainer
  gives the parameters of one process trained at twice the learning rate (2× the gradient), SFTTrainer with
  packing stops with ALST's ``IndexError``, and the 3-head model is refused.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from tests.trainer_runs import BIN, ROOT, free_port, reap, run_command


def _deepspeed_has_alst() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed.runtime.sequence_parallel") is not None


pytestmark = [
    pytest.mark.jobs,  # whole jobs under launchers: CI's second step (docs/testing.md)
    pytest.mark.skipif(
        not _deepspeed_has_alst(),
        reason="DeepSpeed without ALST (the lowest declared, 0.16): accelerate's sequence parallelism cannot run",
    ),
]

SCRIPT = str(ROOT / "launch" / "train_sft.py")
CONFIGS = {"ring": ROOT / "ds_configs" / "sft_ring.json", "hybrid": ROOT / "ds_configs" / "sft_hybrid.json"}
TOLERANCE = 1e-5  # fp32: the shards' sums are added in another order than one process adds them


def _launcher(kind: str, port: int) -> list[str]:
    if kind == "torchrun":
        return [str(BIN / "torchrun"), "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                "--master-port", str(port), SCRIPT, "--sp-size", "2"]  # fmt: skip
    return [str(BIN / "accelerate"), "launch", "--config_file", str(ROOT / "launch" / "accelerate_sp.yaml"),
            "--main_process_port", str(port), SCRIPT]  # fmt: skip


def _run(command: list[str], tmp: Path, name: str, port: int, **env: str) -> tuple[int | None, str]:
    try:
        done = run_command(command, port, tmp / f"{name}.log", timeout=300, **env)
    finally:
        assert reap(str(tmp)) == [], "processes left running"
    return done.code, done.output


def _params(path: Path) -> list[torch.Tensor]:
    return torch.load(path)


def _held_out(output: str) -> float:
    """The held-out loss the script printed (``evaluate()`` after training)."""
    found = re.findall(r"held-out loss (\S+)", output)
    assert found, output[-4000:]
    return float(found[-1])


def _reference(tmp: Path, trainer: str, lora: bool, *extra: str) -> tuple[list[torch.Tensor], float]:
    """One process, no DeepSpeed, no sequence parallelism: the parameters after 3 steps and the held-out loss (cached
    per case)."""
    name = f"reference-{trainer}{'-lora' if lora else ''}{''.join(extra)}".replace("-", "_").replace(".", "_")
    path = tmp / f"{name}.pt"
    if not path.exists():
        command = [sys.executable, SCRIPT, "--reference", "--trainer", trainer, "--output-dir", str(tmp / name),
                   "--final-params", str(path), *(["--lora"] if lora else []), *extra]  # fmt: skip
        code, output = _run(command, tmp, name, free_port())
        assert code == 0, output[-4000:]
    return _params(path), _held_out((tmp / f"{name}.log").read_text())


def _assert_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=TOLERANCE)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("accelerate_sp")


# Each trainer under each launcher runs both strategies, one with the whole model, one with a LoRA adapter.
# CI runs two of them (TRL's packed SFT under accelerate launch, the Trainer under torchrun, both with LoRA); the rest
# are `heavy` (by hand: each case is two launches, ~1-3 min on 2 cores).
IN_CI = {("accelerate", "sft", "ring", True), ("torchrun", "trainer", "hybrid", True)}
CASES = [
    pytest.param(*case, marks=() if case in IN_CI else pytest.mark.heavy)
    for case in (
        (launcher, trainer, strategy, lora)
        for launcher in ("accelerate", "torchrun")
        for trainer in ("trainer", "sft")
        for strategy, lora in (("ring", launcher == "accelerate"), ("hybrid", launcher == "torchrun"))
    )
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("launcher", "trainer", "strategy", "lora"), CASES)
def test_trains_like_one_process(shared: Path, launcher: str, trainer: str, strategy: str, lora: bool) -> None:
    name = f"{launcher}_{trainer}_{strategy}{'_lora' if lora else ''}"
    port = free_port()
    command = _launcher(launcher, port) + ["--trainer", trainer, "--deepspeed_config", str(CONFIGS[strategy]),
                                           "--output-dir", str(shared / name), "--final-params",
                                           str(shared / f"{name}.pt"), *(["--lora"] if lora else [])]  # fmt: skip
    code, output = _run(command, shared, name, port)
    assert code == 0, output[-4000:]
    assert "3 steps on 2 rank(s)" in output, output[-4000:]
    (want, held_out), got = _reference(shared, trainer, lora), _params(shared / f"{name}.pt")
    _assert_equal(got, want)
    assert abs(_held_out(output) - held_out) < TOLERANCE  # evaluate(): whole sequences, the ranks' shares gathered
    if not lora:  # the comparison means something: training moved the parameters far beyond the tolerance
        from launch.train_sft import build_model

        initial = [p.detach() for p in build_model(0).parameters()]
        assert max((a - b).abs().max().item() for a, b in zip(got, initial, strict=True)) > 100 * TOLERANCE


def _without_section(tmp: Path) -> Path:
    config = json.loads(CONFIGS["ring"].read_text())
    del config["ring_attention"]
    path = tmp / "alst.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.heavy
@pytest.mark.timeout(300)
def test_without_a_section_the_run_is_alsts_unchanged(shared: Path) -> None:
    port = free_port()
    common = ["--heads", "4", "--deepspeed_config", str(_without_section(shared))]
    alst = {"PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION": "sdpa"}  # ALST needs it named (ds_ring: the model's own)
    command = _launcher("torchrun", port) + ["--trainer", "trainer", *common, "--length", "24", "--output-dir",
                                             str(shared / "alst"), "--final-params",
                                             str(shared / "alst.pt")]  # fmt: skip
    code, output = _run(command, shared, "alst", port, **alst)
    assert code == 0, output[-4000:]
    twice, _ = _reference(shared, "trainer", False, "--heads", "4", "--length", "24", "--lr", "1.0")  # 2× the gradient
    _assert_equal(_params(shared / "alst.pt"), twice)

    port = free_port()
    sft = ["--trainer", "sft", *common, "--pad-to", "48", "--output-dir", str(shared / "alst_sft")]  # one length
    command = _launcher("torchrun", port) + sft
    code, output = _run(command, shared, "alst_sft", port, **alst)
    assert code not in (0, None), output[-4000:]
    assert "IndexError" in output and "refill" in output, output[-4000:]

    port = free_port()  # the 3-head model of the other tests: ALST cannot split its heads over 2 ranks
    command = _launcher("torchrun", port) + ["--trainer", "trainer", "--deepspeed_config", common[-1],
                                             "--output-dir", str(shared / "alst_heads")]  # fmt: skip
    code, output = _run(command, shared, "alst_heads", port, **alst)
    assert code not in (0, None), output[-4000:]
    assert "Attention head count 3 is not divisible by SP size 2" in output, output[-4000:]


@pytest.mark.timeout(300)
def test_gradient_accumulation_normalised_like_one_process(shared: Path) -> None:
    """2 micro-batches per step: the loss divided by the counted tokens of the whole window, as TRL does in one
    process (``num_items_in_batch``), not by each micro-batch's."""
    port = free_port()
    command = _launcher("torchrun", port) + ["--trainer", "sft", "--accumulation", "2", "--output-dir",
                                             str(shared / "accumulated"), "--final-params",
                                             str(shared / "accumulated.pt")]  # fmt: skip
    code, output = _run(command, shared, "accumulated", port)
    assert code == 0, output[-4000:]
    want, _ = _reference(shared, "sft", False, "--accumulation", "2")
    _assert_equal(_params(shared / "accumulated.pt"), want)


@pytest.mark.heavy
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [0, 1, 3])
def test_lora_at_every_zero_stage(shared: Path, stage: int) -> None:
    """SFTTrainer with TRL's ``peft_config=`` at ZeRO 0, 1 and 3 (2: above) equals one process."""
    config = json.loads(CONFIGS["ring"].read_text())
    config["zero_optimization"] = {"stage": stage}
    path = shared / f"zero{stage}.json"
    path.write_text(json.dumps(config))
    port, name = free_port(), f"lora_zero{stage}"
    command = _launcher("torchrun", port) + ["--trainer", "sft", "--lora", "--deepspeed_config", str(path),
                                             "--output-dir", str(shared / name), "--final-params",
                                             str(shared / f"{name}.pt")]  # fmt: skip
    code, output = _run(command, shared, name, port)
    assert code == 0, output[-4000:]
    want, held_out = _reference(shared, "sft", True)
    _assert_equal(_params(shared / f"{name}.pt"), want)
    assert abs(_held_out(output) - held_out) < TOLERANCE
