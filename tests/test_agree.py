"""agree: ranks that pass different fields all raise one ValueError naming each field and value."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ds_ring.comm import CommTimeoutError, all_reduce
from ds_ring.comm.agree import agree
from ds_ring.hooks import Event, register_hook
from tests.dist import CaseLog, run_distributed

TIMEOUT_S = 5.0


def _raises(fields: dict, op: str, needles: list[str], **kwargs: object) -> None:
    with pytest.raises(ValueError) as caught:
        agree(fields, op=op, timeout_s=TIMEOUT_S, **kwargs)
    message = str(caught.value)
    for needle in needles:
        assert needle in message, (needle, message)


def _two_ranks(rank: int, world: int) -> list[str]:
    log = CaseLog()
    events: list[Event] = []
    register_hook(events.append)
    base = dict(batch=2, rows=64, heads=4, head_dim=8, dtype=torch.float32, segment_lengths=[8, 16],
                causal=True, scale=None, layout="contiguous", cu_seqlens=torch.tensor([0, 64]))  # fmt: skip
    with log.case("equal fields agree once, then from the cache"):
        events.clear()
        agree(base, op="same", timeout_s=TIMEOUT_S)
        assert [e.kind for e in events] == ["all_gather"] and events[0].op == "agree:same"
        events.clear()
        agree(dict(base), op="same", timeout_s=TIMEOUT_S)
        assert events == []
    with log.case("another value is a new fingerprint, exchanged again"):
        events.clear()
        agree({**base, "rows": 128}, op="same", timeout_s=TIMEOUT_S)
        assert len(events) == 1
    differ = [
        ("heads", 4 + rank * -2, ["heads: rank 0 has 4, rank 1 has 2"]),
        ("segment_lengths", [8, 16 * (rank + 1)], ["segment_lengths: rank 0 has [8, 16], rank 1 has [8, 32]"]),
        ("dtype", [torch.float32, torch.bfloat16][rank], ["dtype: rank 0 has torch.float32, rank 1 has torch.bfloat"]),
        ("causal", rank == 0, ["causal: rank 0 has True, rank 1 has False"]),
        ("scale", [None, 0.125][rank], ["scale: rank 0 has None, rank 1 has 0.125"]),
        ("layout", ["contiguous", "zigzag"][rank], ["layout: rank 0 has 'contiguous', rank 1 has 'zigzag'"]),
        ("cu_seqlens", torch.tensor([0, 32 + rank, 64]), ["cu_seqlens: rank 0 has [0, 32, 64], rank 1 has [0, 33,"]),
        ("rows", [64, 64.0][rank], ["rows: rank 0 has 64, rank 1 has 64.0"]),
    ]  # fmt: skip
    for name, value, needles in differ:
        with log.case(f"{name} differs"):
            _raises({**base, name: value}, f"differ_{name}", [*needles, "disagree on differ_", "Fix:"])
    with log.case("two fields differ: both named, nothing else"):
        fields = {**base, "heads": 4 - 2 * rank, "head_dim": 8 + 8 * rank}
        _raises(fields, "two", ["heads: rank 0 has 4, rank 1 has 2; head_dim: rank 0 has 8, rank 1 has 16"])
        with pytest.raises(ValueError) as caught:
            agree(fields, op="two", timeout_s=TIMEOUT_S)
        assert "batch" not in str(caught.value) and "dtype" not in str(caught.value)
    with log.case("a long value is abbreviated with its digest"):
        long = list(range(0, 4000, 4)) + [rank]
        _raises({"cu_seqlens": long}, "long", ["cu_seqlens: rank 0 has [0, 4, 8", "characters, digest"])
    with log.case("other field names: the checked fields are named"):
        fields = {"heads": 4, "head_dim": 8} if rank == 0 else {"heads": 4}
        _raises(fields, "names", ["the checked fields: rank 0 has [heads, head_dim], rank 1 has [heads]", "same code"])
    with log.case("another agreement point"):
        _raises({"heads": 4}, f"point_{rank}", ["the agreement point: rank 0 has point_0, rank 1 has point_1"])
    with log.case("after a disagreement the group still works"):
        agree(base, op="after", timeout_s=TIMEOUT_S)
    with log.case("cache=False exchanges every time, so a rank whose call changed is caught on every rank"):
        events.clear()
        agree({"ring": 2}, op="uncached", timeout_s=TIMEOUT_S, cache=False)
        agree({"ring": 2}, op="uncached", timeout_s=TIMEOUT_S, cache=False)
        assert len(events) == 2
        _raises({"ring": 2 - rank}, "uncached", ["ring: rank 0 has 2, rank 1 has 1"], cache=False)
    with log.case("a group of one agrees without exchanging"):
        alone = [dist.new_group([r]) for r in range(world)][rank]
        events.clear()
        agree({"heads": rank}, group=alone, op="alone", timeout_s=TIMEOUT_S)
        assert events == []
    with log.case("a rank whose call changed while the other repeats an agreed one times out, naming why"):
        group = dist.new_group([0, 1])
        agree({"rows": 64}, group=group, op="cached", timeout_s=TIMEOUT_S)
        if rank == 1:
            with pytest.raises(CommTimeoutError, match=r"repeating a call it agreed on.*op=agree:cached"):
                agree({"rows": 65}, group=group, op="cached", timeout_s=1.0)
        else:
            agree({"rows": 64}, group=group, op="cached", timeout_s=1.0)
        all_reduce(torch.zeros(1), timeout_s=TIMEOUT_S)  # rank 0 stays until rank 1 has timed out
    return log.failures


def _three_ranks(rank: int, world: int) -> list[str]:
    log = CaseLog()
    with log.case("the odd rank out is named, the others grouped"):
        _raises({"heads": 2 if rank == 1 else 4}, "odd", ["heads: ranks 0, 2 have 4, rank 1 has 2"])
    with log.case("a sub-group agrees among its members only"):
        members = [0, 2]
        group = dist.new_group(members)
        if rank in members:
            agree({"heads": 4}, group=group, op="sub", timeout_s=TIMEOUT_S)
            _raises({"heads": rank}, "sub2", ["heads: rank 0 has 0, rank 2 has 2"], group=group)
    return log.failures


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("world", "cases"), [(2, _two_ranks), (3, _three_ranks)])
def test_agree(world: int, cases) -> None:
    failures = run_distributed(cases, world, timeout=90)
    assert not any(failures), "\n".join(f for per_rank in failures for f in per_rank)


def test_without_process_group_agrees_with_itself() -> None:
    assert not dist.is_initialized()
    agree({"heads": 4, "dtype": torch.float16}, op="alone")
