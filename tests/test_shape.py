"""Which shape changes load as they are, through a universal checkpoint, or are refused
(ds_ring.engine.checkpoint_shape)."""

from __future__ import annotations

import pytest

from ds_ring.engine.checkpoint_shape import TrainingShape, how_to_load


def _shape(ranks: int, zero: int, sequence: int | None = None) -> TrainingShape:
    sequence = sequence or ranks
    return TrainingShape(ranks, ranks // sequence, sequence, zero, 4)


@pytest.mark.parametrize(
    ("saved", "current", "expected"),
    [
        (_shape(4, 2), _shape(4, 2, 2), "native"),
        (_shape(4, 0), _shape(2, 0), "native"),
        (_shape(4, 2), _shape(2, 2), "universal"),
        (_shape(2, 1), _shape(4, 2), "universal"),
        (_shape(2, 2), _shape(2, 3), "universal"),
        (_shape(2, 1), _shape(4, 3), "universal"),
        (_shape(2, 3), _shape(4, 3), "universal"),
        (_shape(2, 3), _shape(2, 2), "universal"),
        (_shape(4, 3), _shape(2, 1), "universal"),
    ],
)
def test_how_to_load(saved: TrainingShape, current: TrainingShape, expected: str) -> None:
    assert how_to_load(saved, current) == expected


@pytest.mark.parametrize(
    ("saved", "current", "why", "fix"),
    [
        (_shape(2, 0), _shape(2, 2), "ZeRO stage 0", "stage to 0"),
        (_shape(2, 2), _shape(2, 0), "ZeRO stage 0", "stage to 1, 2 or 3"),
        (_shape(2, 3), _shape(2, 0), "ZeRO stage 0", "stage to 1, 2 or 3"),
    ],
)
def test_refusals_name_both_shapes_and_the_fix(
    saved: TrainingShape, current: TrainingShape, why: str, fix: str
) -> None:
    with pytest.raises(ValueError) as refused:
        how_to_load(saved, current)
    message = str(refused.value)
    assert f"written at ({saved}) and cannot be resumed at ({current})" in message
    assert why in message and fix in message


@pytest.mark.parametrize(("version", "bf16", "fp16", "refused"), [
    ("0.16.0", True, False, True), ("0.16.0", False, True, True), ("0.16.0", False, False, False),
    ("0.19.8", True, False, False),
])  # fmt: skip
def test_half_precision_universal_resume_refused_below_the_tested_deepspeed(
    monkeypatch: pytest.MonkeyPatch, version: str, bf16: bool, fp16: bool, refused: bool
) -> None:
    import deepspeed

    from ds_ring.engine import checkpoint

    class Engine:
        def bfloat16_enabled(self) -> bool:
            return bf16

        def fp16_enabled(self) -> bool:
            return fp16

    monkeypatch.setattr(deepspeed, "__version__", version)
    saved, current = TrainingShape(4, 4, 1, 2, 8), TrainingShape(2, 2, 1, 2, 8)
    if refused:
        with pytest.raises(ValueError, match="deepspeed>=0.19.8"):
            checkpoint._refuse_half_precision_universal(Engine(), saved, current)
    else:
        checkpoint._refuse_half_precision_universal(Engine(), saved, current)
