"""Run a function on ``world_size`` gloo ranks from a test: :mod:`ds_ring.testing` with the tests' preload.

Starting ranks costs 0.1-0.2 s (a preloaded fork server, see :mod:`ds_ring.testing`), still: a test
should start ranks once and check many cases inside its rank function, recording failures with
:class:`CaseLog`.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ds_ring.testing import PRELOAD, rank_results, spawn_ranks

__all__ = ["run_distributed", "CaseLog", "assert_no_failures", "cases_test"]

# What rank functions of tests import anyway: pytest, and torch.distributed.tensor (imported by the
# first assert_close: ~1 s per rank otherwise).
_PRELOAD = (*PRELOAD, "torch.distributed.tensor", "pytest")


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    timeout: float = 60.0,
    *,
    threads_per_rank: int = 1,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, **kwargs)`` on ``world_size`` gloo ranks; return results in rank order.

    ``fn`` must be a module-level function; results and ``kwargs`` must be picklable. ``timeout``
    (seconds, counted from the start, process start-up included) is also the process group's
    timeout. Raises ``RuntimeError`` with ``"rank r failed:\\n<traceback>"`` for every failing rank,
    or, after killing every child, ``TimeoutError("rank r hung: no result after X s")`` naming
    the ranks still running at the deadline.
    """
    outcomes = spawn_ranks(
        fn, world_size, timeout_s=timeout, kwargs=kwargs, threads_per_rank=threads_per_rank, preload=_PRELOAD
    )
    return rank_results(outcomes)


class CaseLog:
    """Collects failures of named checks inside a rank function.

    ``with log.case("all_gather p=3"): ...`` records the traceback of any exception and carries
    on; the rank function returns ``log.failures`` and the test asserts it is empty.
    """

    def __init__(self) -> None:
        self.failures: list[str] = []

    @contextmanager
    def case(self, name: str) -> Iterator[None]:
        try:
            yield
        except Exception:
            self.failures.append(f"{name}:\n{traceback.format_exc()}")


def assert_no_failures(results: list[list[str]]) -> None:
    """Fail with the first few failing cases of every rank's list (what rank functions return)."""
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures[:3])


def cases_test(*cases: Callable[[int, int], list[str]], worlds: Sequence[int], timeout: float = 60.0) -> Callable:
    """A test (assign it to a ``test_*`` name) running each of ``cases`` — rank functions ``(rank, world_size)``
    returning their failures — on every world size of ``worlds``."""
    import pytest

    @pytest.mark.timeout(1.5 * timeout)
    @pytest.mark.parametrize("world_size", worlds)
    @pytest.mark.parametrize("case", cases, ids=[case.__name__.strip("_") for case in cases])
    def test(case: Callable[[int, int], list[str]], world_size: int) -> None:
        assert_no_failures(run_distributed(case, world_size, timeout=timeout))

    return test
