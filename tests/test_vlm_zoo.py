"""transformers' vision-language zoo: every family run equals the whole model, or is refused for its stated reason.

:mod:`tests.vlm_zoo` builds each family with an input recipe tiny (float64, random weights, two images per row, one
across the shard boundary and one across a zigzag chunk boundary) and compares ds_ring on 2 ranks (ring, zigzag ring,
Ulysses) with the whole model on one process: the loss and each parameter's gradient, the vision tower's included.
No family may be *wrong*, *crash* or lack a reference; a refusal must be the one
:data:`~tests.vlm_zoo.EXPECTED_REFUSALS` names. The default run checks :data:`REPRESENTATIVE`; ``pytest -m zoo``
runs every family and compares the table it writes with the committed ``docs/vlm_zoo.md``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vlm_zoo import EXPECTED_REFUSALS, STRATEGIES, families, run, table
from tests.zoo import Outcome, assert_every_family, assert_expected

PAGE = Path(__file__).resolve().parents[1] / "docs" / "vlm_zoo.md"

REPRESENTATIVE = ["qwen3_vl", "idefics3", "gemma3", "paligemma"]
"""MRoPE with deepstack, a pixel-shuffle connector over images per row, Gemma 3's bidirectional image spans, and
PaliGemma's prefix (its mask handed on to its Gemma, positions counted from 1)."""


def _expected(outcome: Outcome) -> str | None:
    return EXPECTED_REFUSALS.get(outcome.family)


@pytest.mark.timeout(3600)
def test_representative_vision_language_families_equal_the_whole_model_or_are_refused():
    outcomes, skipped = run(REPRESENTATIVE, list(STRATEGIES))
    assert_expected(outcomes, _expected, skipped, "not run")


@pytest.mark.zoo
@pytest.mark.heavy  # ~32 min at load 60-78: by hand; the representative families run in the default suite
@pytest.mark.timeout(7200)
def test_every_vision_language_family_and_the_table_is_this_run():
    assert_every_family(run, families(), list(STRATEGIES), _expected, table, PAGE, "tests.vlm_zoo")
