"""The main job (launch/train.py) as 2 hosts × 2 ranks over a veth pair: it trains, survives a slow lossy
link with the same losses, and resumes bit-equal after one host dies.

The ring has 4 ranks (``sequence_parallel_size`` 4), so two of its links (rank 1 -> 2, rank 3 -> 0)
cross the veth every step; DeepSpeed's gradient all-reduce spans both hosts too.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from tests.multihost.hosts import TwoHosts
from tests.trainer_runs import TRAIN, write_config

STEPS, SAVE_EVERY, KILL_AFTER = 12, 3, 5
TIMEOUT_S = 15


def _train(hosts: TwoHosts, run: Path, timeout: float = 120, **env: str) -> list[int | None]:
    """The main job on both hosts into ``run`` (checkpoints, final parameters, per-step metrics); exit codes."""
    run.mkdir(exist_ok=True)
    config = write_config(run / "ds_config.json", sequence_parallel=4, timeout_s=TIMEOUT_S)
    hosts.torchrun([TRAIN, "--deepspeed_config", str(config), "--seq", "512", "--steps", str(STEPS),
                    "--save-every", str(SAVE_EVERY), "--save-dir", str(run / "ckpt"),
                    "--final-params", str(run / "final.pt"), "--metrics-log", str(run / "metrics.jsonl")],
                   run, **env)  # fmt: skip
    return hosts.wait(timeout)


def _metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _losses(run: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in _metrics(run)}


@pytest.fixture(scope="module")
def uninterrupted(hosts: TwoHosts, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("uninterrupted")
    sent = [hosts.bytes_sent(h) for h in (0, 1)]
    codes = _train(hosts, run)
    sent = [hosts.bytes_sent(h) - before for h, before in enumerate(sent)]
    assert codes == [0, 0], hosts.output(0)[-3000:] + hosts.output(1)[-3000:]
    print(f"veth bytes per step, no delay: {sum(sent) / STEPS / 2**20:.2f} MiB (both directions)")
    return run


def test_main_job_runs_as_two_hosts_of_two_ranks(hosts: TwoHosts, uninterrupted: Path) -> None:
    output = hosts.output(0) + hosts.output(1)
    for rank in range(4):
        assert f"rank {rank}:" in output, output[-3000:]
    assert sorted(_losses(uninterrupted)) == list(range(1, STEPS + 1))
    assert (uninterrupted / "ckpt" / "latest").read_text().strip() == f"step{STEPS}"


def test_slow_lossy_link_trains_to_the_same_losses(hosts: TwoHosts, uninterrupted: Path, tmp_path: Path) -> None:
    reason = hosts.netem_unavailable()
    if reason is not None:
        pytest.skip(reason)
    hosts.netem("delay 20ms 5ms loss 1%")
    try:
        sent = [hosts.bytes_sent(h) for h in (0, 1)]
        codes = _train(hosts, tmp_path / "delayed", timeout=150)
        sent = [hosts.bytes_sent(h) - before for h, before in enumerate(sent)]
    finally:
        hosts.netem(None)
    assert codes == [0, 0], hosts.output(0)[-3000:] + hosts.output(1)[-3000:]
    assert _losses(tmp_path / "delayed") == _losses(uninterrupted)
    print(f"veth bytes per step, 20 ms ± 5 ms, 1% loss: {sum(sent) / STEPS / 2**20:.2f} MiB (both directions)")


def test_dead_host_stops_the_other_and_a_relaunch_resumes_bit_equal(
    hosts: TwoHosts, uninterrupted: Path, tmp_path: Path
) -> None:
    run = tmp_path / "killed"
    run.mkdir()
    config = write_config(run / "ds_config.json", sequence_parallel=4, timeout_s=TIMEOUT_S)
    hosts.torchrun([TRAIN, "--deepspeed_config", str(config), "--seq", "512", "--steps", str(STEPS),
                    "--save-every", str(SAVE_EVERY), "--save-dir", str(run / "ckpt"),
                    "--final-params", str(run / "final.pt"), "--metrics-log", str(run / "metrics.jsonl")],
                   run)  # fmt: skip
    deadline = time.monotonic() + 90
    while len(_metrics(run)) < KILL_AFTER and time.monotonic() < deadline and hosts.runs[0].proc.poll() is None:
        time.sleep(0.02)
    assert len(_metrics(run)) >= KILL_AFTER, hosts.output(0)[-3000:]
    hosts.kill_host(1)
    killed_at = time.monotonic()
    codes = hosts.wait(TIMEOUT_S + 30)
    survivor = hosts.output(0)
    assert codes[0] not in (0, None), survivor[-3000:]
    assert time.monotonic() - killed_at < TIMEOUT_S + 30
    exits = [line for line in survivor.splitlines() if "exiting with code 1 after Comm" in line]
    assert len(exits) == 2, survivor[-3000:]  # both ranks of the surviving host, each naming its peer
    assert all(" rank " in line and " step=" in line and "node" in line for line in exits), exits
    latest = (run / "ckpt" / "latest").read_text().strip()
    assert latest != f"step{STEPS}", "the job finished before the host was killed"

    codes = _train(hosts, run)
    assert codes == [0, 0], hosts.output(0)[-3000:] + hosts.output(1)[-3000:]
    resumed = hosts.output(0) + hosts.output(1)
    assert f"resumed from checkpoint {latest} at step {latest.removeprefix('step')}" in resumed, resumed[-3000:]
    final, expected = torch.load(run / "final.pt"), torch.load(uninterrupted / "final.pt")
    assert final.keys() == expected.keys()
    assert [name for name in final if not torch.equal(final[name], expected[name])] == []
