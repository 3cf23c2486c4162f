"""Make the repository root importable (``ds_ring``, ``tests.dist``) however pytest is invoked."""

import os
import sys
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# The tests run on CPU ranks with gloo whatever the machine has; DeepSpeed's JIT-compiled CPU ops
# (~90 s the first time) are cached in the repository (git-ignored) so later runs load them.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(_ROOT) / ".torch_extensions"))


HANG_GUARD_FACTOR = 10
"""pytest-timeout's limits (``timeout`` in pyproject.toml, ``@pytest.mark.timeout``) are hang guards only, this many
times a test's time on a quiet machine: the waits inside a test are on progress (:class:`ds_ring.testing.Progress`),
so a loaded machine slows a test down without failing it."""


SUITE_TIME = frozenset(
    {
        "tests/test_ring_soak.py::test_soak_200_calls_world_4",
        "tests/test_watchdog.py::test_a_rank_that_stops_answering_fails_every_other_rank[sleep]",
        "tests/test_softcap.py::test_one_process[capping]",
        "tests/test_softcap.py::test_one_process[barely capping]",
        "tests/test_dist_helper.py::test_a_failed_rendezvous_is_tried_once_more[2]",
        "tests/test_benchmark_driver.py::test_a_tiny_ring_run_end_to_end",
        "tests/test_packed_sequences.py::test_every_strategy_packed_matches_reference[u4]",
        "tests/test_zero_equivalence.py::test_zero_stages_match_full_batch_training[4seq]",
        "tests/test_hf_windows_and_sinks.py::test_windowed_and_sink_models_match_the_whole_model[4]",
        "tests/test_ulysses_hybrid.py::test_every_strategy_matches_reference[r4]",
        "tests/test_span_masks.py::TestEveryStrategy::test_ring_and_allgather[4]",
        "tests/test_windows_and_sinks.py::TestEveryStrategy::test_ring_and_allgather[4]",
    }
)
"""Cases marked ``slow`` here, so CI's second step runs them and the default suite stays under its 15 minutes: each
has a twin that stays (the same case at 2 or 3 ranks, the other strategies, the other variant; docs/testing.md)."""


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config, items) -> None:
    """Every timeout marker scaled by :data:`HANG_GUARD_FACTOR` (the ini ``timeout`` is scaled in pyproject); the
    cases of :data:`SUITE_TIME` marked ``slow`` (a listed case that its module no longer has is an error)."""
    for item in items:
        marker = item.get_closest_marker("timeout")
        if marker is not None and marker.args:
            item.add_marker(pytest.mark.timeout(marker.args[0] * HANG_GUARD_FACTOR), append=False)
        if item.nodeid in SUITE_TIME:
            item.add_marker(pytest.mark.slow)
    collected = {item.nodeid for item in items}
    modules = {nodeid.split("::")[0] for nodeid in collected}
    gone = sorted(n for n in SUITE_TIME if n.split("::")[0] in modules and n not in collected)
    if gone:
        raise pytest.UsageError(f"tests/conftest.py SUITE_TIME names cases that do not exist: {gone}")


def pytest_sessionstart(session) -> None:
    """A lock left by a killed build of DeepSpeed's ops is removed at once, with a warning naming it (it would hang
    every test that starts DeepSpeed)."""
    from ds_ring.engine.build_locks import clear_stale_build_locks

    clear_stale_build_locks()
