"""``hosts``: two network hosts joined by a veth pair (:mod:`tests.multihost.hosts`), one pair per module."""

from __future__ import annotations

import atexit
from collections.abc import Iterator

import pytest

from tests.multihost.hosts import TwoHosts, unavailable


@pytest.fixture(scope="module")
def hosts() -> Iterator[TwoHosts]:
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"two hosts on one machine: {reason}")
    pair = TwoHosts()
    atexit.register(pair.close)  # also when pytest itself is interrupted before the teardown
    try:
        yield pair.open()
    finally:
        pair.close()
        atexit.unregister(pair.close)
