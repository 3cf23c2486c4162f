"""all_gather / reduce_scatter / all_to_all: exact results on whole groups and sub-spans, both paths."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from ds_ring.comm import CommError, all_gather, all_to_all, backends, reduce_scatter
from ds_ring.comm.torch_compat import reduce_scatter_single
from ds_ring.hooks import Event, register_hook
from tests.dist import CaseLog, cases_test

WORLD_SIZES = [1, 2, 3, 4]
DTYPES = [torch.float32, torch.bfloat16, torch.int64]
PATHS = [(dtype, force_p2p) for dtype in DTYPES for force_p2p in (False, True)]


def _payload(owner: int, numel: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Small integers (exact in every dtype) that say who made them and for whom."""
    return (torch.arange(numel) % 7 + 10 * owner + salt).to(dtype)


def _spans(world_size: int) -> list[list[int]]:
    """The whole world, contiguous pairs (a lone last rank included), and a reversed order."""
    pairs = [list(range(s, min(s + 2, world_size))) for s in range(0, world_size, 2)]
    return [list(range(world_size)), *pairs, list(reversed(range(world_size)))]


def _my_spans(rank: int, world_size: int) -> list[list[int]]:
    return [span for span in _spans(world_size) if rank in span]


def _paths(rank: int, world_size: int) -> list[tuple[list[int], torch.dtype, bool]]:
    """``(span, dtype, force_p2p)``: every span this rank is in, on both paths in every dtype."""
    return [(span, dtype, force_p2p) for span in _my_spans(rank, world_size) for dtype, force_p2p in PATHS]


def _recording() -> tuple[CaseLog, list[Event]]:
    """A rank function's start: a case log, and the list the hooks record events into."""
    events: list[Event] = []
    register_hook(events.append)
    return CaseLog(), events


def _one_event(
    events: list[Event], span: list[int], world_size: int, force_p2p: bool, *, kind: str, op: str, step: int
) -> Event | None:
    """The one event of an operation among ``span``, on the path the backend and ``force_p2p`` choose (the
    collective only for the whole world); ``None`` for a span of one, which emits none."""
    if len(span) == 1:
        assert events == []
        return None
    (event,) = events
    assert (event.kind, event.op, event.step) == (kind, op, step)
    whole = span == list(range(world_size))
    assert event.extra["path"] == ("collective" if whole and not force_p2p else "p2p")
    return event


def _gather_cases(rank: int, world_size: int) -> list[str]:
    log, events = _recording()
    for span, dtype, force_p2p in _paths(rank, world_size):
        with log.case(f"all_gather span={span} {dtype} force_p2p={force_p2p}"):
            events.clear()
            parts = all_gather(_payload(rank, 6, dtype), span, force_p2p=force_p2p, op="ag", step=3)
            assert len(parts) == len(span)
            for member, part in zip(span, parts, strict=True):
                assert_close(part, _payload(member, 6, dtype), rtol=0, atol=0)
            event = _one_event(events, span, world_size, force_p2p, kind="all_gather", op="ag", step=3)
            if event is not None:
                assert event.rank == rank
                assert event.extra["span"] == span
                itemsize = torch.empty(0, dtype=dtype).element_size()
                assert event.nbytes == 6 * itemsize * (len(span) - 1)
                assert event.extra["sent_bytes"] == 6 * itemsize * (len(span) - 1)
    for span in _my_spans(rank, world_size):
        with log.case(f"all_gather span={span} unequal sizes"):
            numels = [member + 1 for member in span]
            events.clear()
            parts = all_gather(_payload(rank, rank + 1, torch.float32), span, numels=numels)
            for member, part in zip(span, parts, strict=True):
                assert_close(part, _payload(member, member + 1, torch.float32), rtol=0, atol=0)
            if len(span) > 1:
                assert events[0].extra["path"] == "p2p"
                assert events[0].nbytes == 4 * (sum(numels) - (rank + 1))
    with log.case("all_gather rejects bad arguments"):
        if world_size > 1:
            with pytest.raises(ValueError, match="not part of"):
                all_gather(torch.ones(2), [r for r in range(world_size) if r != rank])
        with pytest.raises(ValueError, match=rf"ranks \[{world_size}\] of span .* not in the process group"):
            all_gather(torch.ones(2), [rank, world_size])
        with pytest.raises(ValueError, match="flat 1-D"):
            all_gather(torch.ones(2, 2), [rank])
        with pytest.raises(ValueError, match="numels"):
            all_gather(torch.ones(2), [rank], numels=[3])
        with pytest.raises(ValueError, match="repeats"):
            all_gather(torch.ones(2), [rank, rank])
    return log.failures


def _reduce_scatter_cases(rank: int, world_size: int) -> list[str]:
    log, events = _recording()
    for span, dtype, force_p2p in _paths(rank, world_size):
        with log.case(f"reduce_scatter span={span} {dtype} force_p2p={force_p2p}"):
            events.clear()
            contributions = [_payload(rank, 5, dtype, salt=3 * target) for target in span]
            got = reduce_scatter(contributions, span, force_p2p=force_p2p, op="rs", step=1)
            expected = sum(_payload(member, 5, torch.int64, salt=3 * rank) for member in span)
            assert_close(got, expected.to(dtype), rtol=0, atol=0)
            _one_event(events, span, world_size, force_p2p, kind="reduce_scatter", op="rs", step=1)
    for span in _my_spans(rank, world_size):
        with log.case(f"reduce_scatter span={span} unequal sizes"):
            contributions = [_payload(rank, target + 2, torch.float32) for target in span]
            got = reduce_scatter(contributions, span)
            expected = sum(_payload(member, rank + 2, torch.float32) for member in span)
            assert got.shape == (rank + 2,)
            assert_close(got, expected, rtol=0, atol=0)
        with log.case(f"reduce_scatter span={span} does not modify the contributions"):
            contributions = [torch.full((3,), float(rank)) for _ in span]
            reduce_scatter(contributions, span, force_p2p=True)
            assert all(torch.equal(c, torch.full((3,), float(rank))) for c in contributions)
    with log.case("reduce_scatter needs one contribution per member"), pytest.raises(ValueError, match="one contri"):
        reduce_scatter([torch.ones(2)] * (world_size + 1), list(range(world_size)))
    if world_size > 1:
        name = reduce_scatter_single().__name__  # the collective the installed torch runs
        collective, calls = getattr(dist, name), []

        def refuse(*args: object, **kwargs: object) -> None:
            calls.append(1)
            raise RuntimeError("ProcessGroupGloo does not support reduce_scatter")

        span = list(range(world_size))
        setattr(dist, name, refuse)
        try:
            with log.case("a collective that fails to post raises, never switches path behind the other ranks"):
                for _ in range(2):  # and nothing is remembered: the next call tries again
                    with pytest.raises(CommError, match="posting reduce_scatter among ranks .*does not support"):
                        reduce_scatter([torch.ones(4)] * world_size, span)
                assert calls == [1, 1]
            with log.case("a backend the table does not list takes the point-to-point path on every rank"):
                calls.clear()
                with mock.patch.dict(backends.COLLECTIVES, clear=True):
                    events.clear()
                    got = reduce_scatter([torch.full((4,), float(rank + t)) for t in span], span)
                assert_close(got, torch.full((4,), float(sum(span) + world_size * rank)))
                assert events[0].extra["path"] == "p2p" and calls == []
        finally:
            setattr(dist, name, collective)
    return log.failures


def _all_to_all_cases(rank: int, world_size: int) -> list[str]:
    log, events = _recording()
    world = list(range(world_size))
    # Row block j of rank r's input holds 100 * r + j: it goes to rank j.
    for dtype, force_p2p in PATHS:
        with log.case(f"all_to_all world {dtype} force_p2p={force_p2p}"):
            events.clear()
            rows = torch.arange(world_size).repeat_interleave(2) + 100 * rank
            x = rows.view(-1, 1, 1).expand(-1, 3, 2).to(dtype)
            got = all_to_all(x, force_p2p=force_p2p, op="a2a", step=2)
            expected = (100 * torch.arange(world_size).repeat_interleave(2) + rank).view(-1, 1, 1)
            assert_close(got, expected.expand(-1, 3, 2).to(dtype), rtol=0, atol=0)
            event = _one_event(events, world, world_size, force_p2p, kind="all_to_all", op="a2a", step=2)
            if event is not None:
                assert event.nbytes == 2 * 3 * 2 * x.element_size() * (world_size - 1)
    members = list(range(1, world_size)) if world_size > 2 else list(range(world_size))
    group = dist.new_group(members)
    if rank in members:
        me = members.index(rank)
        for force_p2p in (False, True):
            with log.case(f"all_to_all in sub-group {members} force_p2p={force_p2p}"):
                x = (torch.arange(len(members)) + 10 * me).float().view(-1, 1)
                got = all_to_all(x, group=group, force_p2p=force_p2p)
                assert_close(got, (10 * torch.arange(len(members)) + me).float().view(-1, 1), rtol=0, atol=0)
    with log.case("all_to_all needs dim 0 divisible by the group"), pytest.raises(ValueError, match="divisible"):
        all_to_all(torch.ones(world_size + 1) if world_size > 1 else torch.ones(()))
    return log.failures


test_collectives = cases_test(_gather_cases, _reduce_scatter_cases, _all_to_all_cases, worlds=WORLD_SIZES)


def test_single_process_without_process_group() -> None:
    assert not dist.is_initialized()
    x = torch.arange(4.0)
    (part,) = all_gather(x, [0])
    assert_close(part, x)
    assert_close(reduce_scatter([x], [0]), x)
    assert_close(all_to_all(x.view(2, 2)), x.view(2, 2))


def test_collective_or_point_to_point_is_decided_from_the_backend_alone() -> None:
    for backend in ("gloo", "nccl", "NCCL"):
        for kind in ("all_gather", "reduce_scatter", "all_to_all"):
            assert backends.runs_collective(backend, kind, torch.bfloat16), (backend, kind)
    assert backends.runs_collective("mpi", "all_to_all", torch.float32)
    assert not backends.runs_collective("mpi", "reduce_scatter", torch.float32)
    assert not backends.runs_collective("mpi", "all_gather", torch.float32)
    assert not backends.runs_collective("mpi", "all_to_all", torch.bfloat16)  # no MPI datatype for it
    assert not backends.runs_collective("gloo", "all_gather", torch.float8_e4m3fn)
    assert not backends.runs_collective("ucc", "all_gather", torch.float32)  # not listed: point-to-point
