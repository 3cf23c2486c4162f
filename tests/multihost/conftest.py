"""``hosts``: two network hosts joined by a veth pair (:mod:`tests.multihost.hosts`), one pair per module;
``slow_hosts``: the same joined by a user-space wire delaying frames 20 ms ± 5 ms and dropping 1%."""

from __future__ import annotations

import atexit
from collections.abc import Iterator

import pytest

from tests.multihost.hosts import TwoHosts, Wire, unavailable


@pytest.fixture(scope="module")
def hosts() -> Iterator[TwoHosts]:
    yield from _opened(TwoHosts())


@pytest.fixture(scope="module")
def slow_hosts() -> Iterator[TwoHosts]:
    yield from _opened(TwoHosts(wire=Wire(delay_ms=20, jitter_ms=5, loss=0.01)))


def _opened(pair: TwoHosts) -> Iterator[TwoHosts]:
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"two hosts on one machine: {reason}")
    atexit.register(pair.close)  # also when pytest itself is interrupted before the teardown
    try:
        yield pair.open()
    finally:
        pair.close()
        atexit.unregister(pair.close)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test here is marked ``multihost``: .ci/run runs them in their own step (``pytest -m "zoo or
    multihost"``), which keeps the README's test command under 15 minutes on 2 cores."""
    for item in items:
        if "tests/multihost/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.multihost)
