"""The session of ``register_with_transformers`` and the engine's attachments, in one process: explicit state only.

What a session closes (last added first), the gradient scale before the model ran, the error a Topology passed where
the session goes gets, and the monitor / exit flush / signal handlers held by the engine rather than the module.
"""

from types import SimpleNamespace

import pytest

from ds_ring.config import MonitoringConfig, RingAttentionConfig


def _session(**fields):
    from ds_ring.integrations.hf.session import SequenceParallelSession

    topology = SimpleNamespace()  # a stand-in: a ds_ring.Topology needs torch.distributed; the session only holds it
    return SequenceParallelSession(RingAttentionConfig(enabled=False, sequence_parallel_size=1), topology, None, None,
                                   **fields)  # fmt: skip


def test_a_session_closes_what_it_holds_last_first_and_once():
    closed = []
    session = _session()
    session.on_close(lambda: closed.append("registries"))
    session.on_close(lambda: closed.append("model"))
    with session as entered:
        assert entered is session and session.gradient_scale == 1  # no attention: nothing to scale
    assert closed == ["model", "registries"]
    session.close()
    assert closed == ["model", "registries"], "a second close does nothing"


def test_calls_refuse_a_topology_where_the_session_goes():
    from ds_ring.integrations.hf import SequenceParallelDataLoader, causal_lm_loss, shard_batch

    topology = SimpleNamespace()  # what older releases passed (a Topology needs torch.distributed)
    for call in (lambda: shard_batch(topology, {}), lambda: causal_lm_loss(topology, None, None),
                 lambda: SequenceParallelDataLoader([], topology)):  # fmt: skip
        with pytest.raises(TypeError, match="SequenceParallelSession that register_with_transformers returns"):
            call()


def test_nothing_is_installed_without_a_registration():
    from ds_ring.integrations.hf.session import installed_sessions

    assert installed_sessions() == []
    assert not _session().installed


def test_the_engine_holds_its_monitor_and_preemption():
    from ds_ring.config import PreemptionConfig
    from ds_ring.engine import initialize as glue

    engines = [SimpleNamespace(), SimpleNamespace()]
    monitors = [glue.attach_monitor(e, SimpleNamespace(), MonitoringConfig(watchdog=False)) for e in engines]
    handlers = [glue.attach_preemption(e, PreemptionConfig(enabled=False)) for e in engines]
    assert [e.ring_monitor for e in engines] == monitors and [e.preemption for e in engines] == handlers
    assert not hasattr(glue, "_attached") and not hasattr(glue, "_forget_flush"), "no module-level engine state"
    glue.attachments_of(engines[0]).close()
    assert glue.attachments_of(engines[0]).monitor is None and glue.attachments_of(engines[1]).monitor is monitors[1]
    glue.attachments_of(engines[1]).close()
