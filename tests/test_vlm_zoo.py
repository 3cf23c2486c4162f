"""transformers' vision-language zoo: every family run equals the whole model, or is refused for its stated reason.

:mod:`tests.vlm_zoo` builds each family with an input recipe tiny (float64, random weights, two images per row, one
across the shard boundary and one across a zigzag chunk boundary) and compares ds_ring on 2 ranks (ring, zigzag ring,
Ulysses) with the whole model on one process: the loss and each parameter's gradient, the vision tower's included.
No family may be *wrong*, *crash* or lack a reference; a refusal must be the one
:data:`~tests.vlm_zoo.EXPECTED_REFUSALS` names. The default run checks :data:`REPRESENTATIVE`; ``pytest -m zoo``
runs every family and compares the table it writes with the committed ``docs/vlm_zoo.md``.
"""

from __future__ import annotations

import difflib
import re
import time
from pathlib import Path

import pytest

from tests.vlm_zoo import EXPECTED_REFUSALS, STRATEGIES, families, run, table
from tests.zoo import without_run_time

PAGE = Path(__file__).resolve().parents[1] / "docs" / "vlm_zoo.md"

REPRESENTATIVE = ["qwen3_vl", "idefics3", "gemma3", "paligemma"]
"""MRoPE with deepstack, a pixel-shuffle connector over images per row, Gemma 3's bidirectional image spans, and
PaliGemma's prefix (its mask handed on to its Gemma, positions counted from 1)."""


def _problems(outcomes: list) -> list[str]:
    problems = []
    for outcome in outcomes:
        expected = EXPECTED_REFUSALS.get(outcome.family)
        where = f"{outcome.family} ({outcome.strategy}): {outcome.status}: {outcome.detail}"
        if expected is None and outcome.status != "equal":
            problems.append(f"{where} (expected equal)")
        elif expected is not None and not (outcome.status == "refused" and re.search(expected, outcome.detail)):
            problems.append(f"{where} (expected refused: {expected})")
    return problems


@pytest.mark.timeout(3600)
def test_representative_vision_language_families_equal_the_whole_model_or_are_refused():
    outcomes, skipped = run(REPRESENTATIVE, list(STRATEGIES))
    problems = _problems(outcomes) + [f"{name}: not run: {why}" for name, why in skipped.items()]
    assert not problems, f"{len(problems)} families off:\n" + "\n".join(problems)


@pytest.mark.zoo
@pytest.mark.heavy  # ~32 min at load 60-78: by hand; the representative families run in the default suite
@pytest.mark.timeout(7200)
def test_every_vision_language_family_and_the_table_is_this_run():
    start = time.perf_counter()
    outcomes, skipped = run(families(), list(STRATEGIES))
    problems = _problems(outcomes)
    assert not problems, f"{len(problems)} families off:\n" + "\n".join(problems)
    fresh = without_run_time(table(outcomes, skipped, time.perf_counter() - start))
    committed = without_run_time(PAGE.read_text())
    diff = "".join(difflib.unified_diff(committed.splitlines(True), fresh.splitlines(True), "committed", "this run"))
    assert not diff, f"{PAGE} differs from this run; regenerate it with `python -m tests.vlm_zoo`:\n{diff}"
