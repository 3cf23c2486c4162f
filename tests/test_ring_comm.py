"""RingComm: blocks travel the ring intact, misuse is refused, traffic and live blocks are measured."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from ds_ring.comm import RingComm
from ds_ring.hooks import Event, register_hook
from tests.dist import CaseLog, cases_test

WORLD_SIZES = [1, 2, 3, 4]


def _block(owner: int, rows: int = 3, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A [rows, 5] block whose values say which rank made it."""
    return (torch.arange(rows * 5, dtype=torch.float64).view(rows, 5) + 100 * owner).to(dtype)


def _neighbours(rank: int, world_size: int) -> tuple[int, int]:
    return (rank + 1) % world_size, (rank - 1) % world_size


def _exchange(comm: RingComm, block: torch.Tensor, step: int, **recv: object) -> torch.Tensor:
    incoming = comm.send_recv(block, **recv)
    comm.commit(step)
    comm.wait()
    return incoming


def _blocks_travel(rank: int, world_size: int) -> list[str]:
    log = CaseLog()
    nxt, prv = _neighbours(rank, world_size)
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        with log.case(f"full turn {dtype}"):
            comm = RingComm(None, nxt, prv, op="ring_kv")
            block = _block(rank, dtype=dtype)
            for step in range(world_size):
                block = _exchange(comm, block, step)
                assert_close(block, _block((rank - step - 1) % world_size, dtype=dtype), rtol=0, atol=0)
            assert_close(block, _block(rank, dtype=dtype), rtol=0, atol=0)
    with log.case("shards of different sizes"):
        comm = RingComm(None, nxt, prv)
        got = _exchange(comm, _block(rank, rows=rank + 1), 0, recv_shape=(prv + 1, 5), recv_dtype=torch.float32)
        assert_close(got, _block(prv, rows=prv + 1), rtol=0, atol=0)
    with log.case("non-contiguous send arrives contiguous"):
        got = _exchange(RingComm(None, nxt, prv), _block(rank).t(), 0)
        assert got.is_contiguous()
        assert_close(got, _block(prv).t(), rtol=0, atol=0)
    with log.case("receive into a given buffer"):
        buffer = torch.empty(3, 5)
        got = _exchange(RingComm(None, nxt, prv), _block(rank), 0, recv_buffer=buffer)
        assert got is buffer
        assert_close(buffer, _block(prv), rtol=0, atol=0)
    with log.case("several transfers in one commit"):
        comm = RingComm(None, nxt, prv)
        k = comm.send_recv(_block(rank))
        v = comm.send_recv(-_block(rank, rows=2), recv_shape=(2, 5))
        comm.commit(0)
        comm.wait()
        assert_close(k, _block(prv), rtol=0, atol=0)
        assert_close(v, -_block(prv, rows=2), rtol=0, atol=0)
    with log.case("reverse ring"):
        assert_close(_exchange(RingComm(None, prv, nxt), _block(rank), 0), _block(nxt), rtol=0, atol=0)
    with log.case("sub-rings of two ranks, a lone rank copies to itself"):
        span = [r for r in range(world_size) if r // 2 == rank // 2]
        me = span.index(rank)
        send_to, recv_from = span[(me + 1) % len(span)], span[(me - 1) % len(span)]
        assert_close(_exchange(RingComm(None, send_to, recv_from), _block(rank), 0), _block(recv_from))
    with log.case("ring in a sub-group uses global ranks"):
        members = list(range(1, world_size)) if world_size > 2 else list(range(world_size))
        group = dist.new_group(members)
        if rank in members:
            me = members.index(rank)
            send_to, recv_from = members[(me + 1) % len(members)], members[(me - 1) % len(members)]
            got = _exchange(RingComm(group, send_to, recv_from), _block(rank), 0)
            assert_close(got, _block(recv_from), rtol=0, atol=0)
    with log.case("a ring of one returns a copy"):
        sent = _block(rank)
        got = _exchange(RingComm(None, rank, rank), sent, 0)
        assert got.data_ptr() != sent.data_ptr()
        assert_close(got, sent, rtol=0, atol=0)
        with pytest.raises(ValueError, match="receives what it sends"):
            RingComm(None, rank, rank).send_recv(sent, recv_shape=(2, 5))
    if world_size > 1:
        with log.case("half a ring of one is refused"), pytest.raises(ValueError, match="a ring of one"):
            RingComm(None, rank, prv)
    with log.case("peers outside the group are refused"), pytest.raises(ValueError, match="not in the process group"):
        RingComm(None, world_size, world_size + 1)
    return log.failures


def _misuse_is_refused(rank: int, world_size: int) -> list[str]:
    log = CaseLog()
    nxt, prv = _neighbours(rank, world_size)
    comm = RingComm(None, nxt, prv, op="ring_kv")
    with log.case("wait before commit"), pytest.raises(RuntimeError, match=r"wait\(\) before commit\(\)"):
        comm.wait()
    with log.case("commit with nothing queued"), pytest.raises(RuntimeError, match="nothing queued"):
        comm.commit(0)
    with log.case("commit twice"):
        got = comm.send_recv(_block(rank))
        comm.commit(0)
        with pytest.raises(RuntimeError, match=r"commit\(\) called twice without wait\(\) \(step 0"):
            comm.commit(1)
        comm.wait()
        assert_close(got, _block(prv), rtol=0, atol=0)
    with log.case("send_recv between commit and wait"):
        got = comm.send_recv(_block(rank))
        comm.commit(1)
        with pytest.raises(RuntimeError, match=r"between commit\(\) and wait\(\)"):
            comm.send_recv(_block(rank))
        comm.wait()
        assert_close(got, _block(prv), rtol=0, atol=0)
    with log.case("second wait"), pytest.raises(RuntimeError, match=r"wait\(\) before commit\(\)"):
        comm.wait()
    with log.case("buffer and shape together"), pytest.raises(ValueError, match="not both"):
        comm.send_recv(_block(rank), torch.empty(3, 5), recv_shape=(3, 5))
    with log.case("non-contiguous buffer"), pytest.raises(ValueError, match="contiguous"):
        comm.send_recv(_block(rank), torch.empty(5, 3).t())
    with log.case("non-positive timeout"), pytest.raises(ValueError, match="> 0"):
        RingComm(None, nxt, prv, timeout_s=0)
    with log.case("the ring still works after refused calls"):
        assert_close(_exchange(comm, _block(rank), 2), _block(prv), rtol=0, atol=0)
    return log.failures


def _traffic_is_measured(rank: int, world_size: int) -> list[str]:
    log = CaseLog()
    nxt, prv = _neighbours(rank, world_size)
    events: list[Event] = []
    register_hook(lambda e: events.append(e) if e.kind in ("send", "recv") else None)

    def live_counts(op: str) -> list[int]:
        return [e.extra["live_remote_blocks"] for e in events if e.kind == "recv" and e.op == op]

    with log.case("one send and one recv event per hop, with bytes, peers and steps"):
        comm = RingComm(None, nxt, prv, op="ring_kv")
        block = _block(rank, rows=rank + 1)
        for step in range(world_size - 1):
            owner = (rank - step - 1) % world_size
            block = _exchange(comm, block, step, recv_shape=(owner + 1, 5))
        sends = [e for e in events if e.kind == "send" and e.op == "ring_kv"]
        recvs = [e for e in events if e.kind == "recv" and e.op == "ring_kv"]
        hops = range(world_size - 1)
        assert [(e.rank, e.peer, e.step) for e in sends] == [(rank, nxt, s) for s in hops]
        assert [(e.rank, e.peer, e.step) for e in recvs] == [(rank, prv, s) for s in hops]
        assert [e.nbytes for e in sends] == [((rank - s) % world_size + 1) * 5 * 4 for s in hops]
        assert [e.nbytes for e in recvs] == [((rank - s - 1) % world_size + 1) * 5 * 4 for s in hops]
        assert all(e.seconds >= 0 for e in sends + recvs)
    with log.case("a double-buffered loop holds at most two remote blocks"):
        comm = RingComm(None, nxt, prv, op="double_buffered")
        block = _block(rank)
        for step in range(6):
            incoming = comm.send_recv(block)
            comm.commit(step)
            block.mul_(1)  # stands in for the compute on the current block
            comm.wait()
            block = incoming
        expected = [] if world_size == 1 else [1, 2, 2, 2, 2, 2]
        assert live_counts("double_buffered") == expected
    with log.case("K and V sent separately count as one block per step"):
        comm = RingComm(None, nxt, prv, op="kv_pair")
        k, v = _block(rank), -_block(rank)
        for step in range(4):
            next_k, next_v = comm.send_recv(k), comm.send_recv(v)
            comm.commit(step)
            comm.wait()
            k, v = next_k, next_v
        assert live_counts("kv_pair") == ([] if world_size == 1 else [1, 1, 2, 2, 2, 2, 2, 2])
    with log.case("two reused receive buffers hold two blocks"):
        comm = RingComm(None, nxt, prv, op="reused")
        buffers = [torch.empty(3, 5), torch.empty(3, 5)]
        block = _block(rank)
        for step in range(5):
            block = _exchange(comm, block, step, recv_buffer=buffers[step % 2])
        assert live_counts("reused") == ([] if world_size == 1 else [1, 2, 2, 2, 2])
    with log.case("hoarded blocks are counted, released ones are not"):
        comm = RingComm(None, nxt, prv, op="hoard")
        kept = [_block(rank)]
        for step in range(4):
            kept.append(_exchange(comm, kept[-1], step))
        last = kept[-1]
        del kept
        _exchange(comm, last, 4)
        assert live_counts("hoard") == ([] if world_size == 1 else [1, 2, 3, 4, 2])
    return log.failures


test_ring_comm = cases_test(_blocks_travel, _misuse_is_refused, _traffic_is_measured, worlds=WORLD_SIZES)
