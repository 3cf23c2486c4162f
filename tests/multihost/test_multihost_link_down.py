"""The veth between the two hosts goes down mid-step: every rank of the main job (2 hosts × 2 ranks, ring of 4
across both) exits within its bound + 10 s (``timeout_s`` for ds_ring's exchanges, the process group's 2 ×
``timeout_s`` for DeepSpeed's collectives) with a CommTimeoutError / CommError naming itself, its host,
the operation and the step, wherever the step was: in ds_ring's ring exchanges, or inside DeepSpeed's
gradient all-reduce (the collective named). Nothing hangs.

Where the step is held is made certain with ``DS_RING_FAULT``: one rank stalls for a few seconds before its
first ring transfer (``sleep``) or at the start of DeepSpeed's gradient all-reduce (``sleep_in_reduce``), so
the other ranks wait there when the link drops.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from ds_ring.comm.wait import process_group_timeout_s
from ds_ring.testing import Progress
from tests.multihost.hosts import TwoHosts
from tests.trainer_runs import TRAIN, write_config

TIMEOUT_S, FAULT_STEP, STALL_S = 10, 3, 4
EXIT = re.compile(r"ds_ring: rank (\d) exiting with code 1 after (Comm\w*Error): (.*)")


@pytest.mark.parametrize(
    ("fault", "where"),
    [("sleep", r"op=ring_\w+"), ("sleep_in_reduce", r"DeepSpeed's all_reduce over ranks .* on node.*op=deepspeed")],
    ids=["ring_exchange", "deepspeed_all_reduce"],
)
def test_link_down_mid_step_every_rank_names_itself_its_peer_and_the_step(
    hosts: TwoHosts, tmp_path: Path, fault: str, where: str
) -> None:
    config = write_config(tmp_path / "ds_config.json", sequence_parallel=4, timeout_s=TIMEOUT_S)
    hosts.torchrun([TRAIN, "--deepspeed_config", str(config), "--seq", "512", "--steps", "40", "--save-every", "0",
                    "--save-dir", str(tmp_path / "ckpt")], tmp_path,
                   DS_RING_FAULT=f"{fault}:rank=0:step={FAULT_STEP}:seconds={STALL_S}")  # fmt: skip
    try:
        logs = lambda: hosts.output(0) + hosts.output(1)  # noqa: E731
        progress = Progress(lambda: [r.proc.pid for r in hosts.runs], 90)  # a hang guard: the log is waited on
        while "ds_ring fault injection" not in logs() and not progress.stalled():
            time.sleep(0.05)
        assert "ds_ring fault injection" in logs(), logs()[-3000:]
        time.sleep(0.5)  # the other ranks are now waiting on rank 0
        hosts.link(up=False)
        down_at = time.monotonic()
        # ds_ring's own exchanges are bounded by timeout_s; DeepSpeed's collectives only by the process group's
        # timeout, which is process_group_timeout_s(timeout_s) (2x: the backstop behind ds_ring's named waits)
        bound = TIMEOUT_S if fault == "sleep" else process_group_timeout_s(TIMEOUT_S)
        while len(EXIT.findall(logs())) < 4 and time.monotonic() < down_at + bound + STALL_S + 20:
            time.sleep(0.1)
        took = time.monotonic() - down_at
    finally:
        hosts.wait(0)  # the agents may still wait for the rendezvous store across the dead link: killed
        hosts.link(up=True)
    exits = {int(rank): (kind, message) for rank, kind, message in EXIT.findall(logs())}
    assert sorted(exits) == [0, 1, 2, 3], logs()[-4000:]
    assert took <= bound + 10, f"last rank exited {took:.1f} s after the link went down (bound {bound} s + 10 s)"
    for rank, (_, message) in exits.items():
        assert re.match(rf"ds_ring: rank {rank} on node[01] ", message), message
        assert re.search(r"step=\d+", message), message
    assert any(re.search(where, message) for _, message in exits.values()), exits
    print(f"{fault}: every rank exited {took:.1f} s after the link went down; " + exits[1][1])
