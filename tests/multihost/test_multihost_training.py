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

from ds_ring.testing import Progress
from tests.multihost.hosts import TwoHosts
from tests.trainer_runs import TRAIN, write_config

STEPS, SAVE_EVERY, KILL_AFTER, SLOW_STEPS = 12, 3, 5, 4
TIMEOUT_S = 15


def _train(
    hosts: TwoHosts, run: Path, timeout: float = 120, steps: int = STEPS, samples: list | None = None
) -> list[int | None]:
    """The main job on both hosts into ``run`` (checkpoints, final parameters, per-step metrics); exit codes.
    ``samples`` receives ``(steps logged, bytes sent over the link)`` every 50 ms."""
    run.mkdir(exist_ok=True)
    config = write_config(run / "ds_config.json", sequence_parallel=4, timeout_s=TIMEOUT_S)
    hosts.torchrun([TRAIN, "--deepspeed_config", str(config), "--seq", "512", "--steps", str(steps),
                    "--save-every", str(SAVE_EVERY), "--save-dir", str(run / "ckpt"),
                    "--final-params", str(run / "final.pt"), "--metrics-log", str(run / "metrics.jsonl")],
                   run)  # fmt: skip
    sample = None if samples is None else lambda: samples.append((len(_metrics(run)), hosts.bytes_sent()))
    return hosts.wait(timeout, sample)


def _metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _losses(run: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in _metrics(run)}


def _report(run: Path, samples: list[tuple[int, int]], label: str) -> None:
    """Print the link's bytes per step (between the first and the last step seen logged) and the ring's overlap
    (attention wall ÷ compute, slowest rank) after the first step."""
    first = next(s for s in samples if s[0] >= 1)
    last = max((s for s in samples if s[0] > first[0]), default=None, key=lambda s: (s[0], -s[1]))
    link = "n/a" if last is None else f"{(last[1] - first[1]) / (last[0] - first[0]) / 2**20:.2f} MiB/step"
    metrics = _metrics(run)[1:]
    wall = sum(m["attention_ms_max"] for m in metrics) / sum(m["attention_compute_ms_max"] for m in metrics)
    hidden = min(m["comm_hidden_share_min"] for m in metrics)
    ring = sum(m["sent_bytes_max"] for m in metrics) / len(metrics) / 2**10
    step_ms = sum(m["step_ms_max"] for m in metrics) / len(metrics)
    print(f"{label}: link {link} (both ways, steps {first[0]}-{last and last[0]}); ring sends "
          f"{ring:.0f} KiB/step/rank; attention wall ÷ compute {wall:.2f}; hidden share >= {hidden:.2f}; "
          f"step {step_ms:.0f} ms")  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(hosts: TwoHosts, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("uninterrupted")
    samples: list[tuple[int, int]] = []
    codes = _train(hosts, run, samples=samples)
    assert codes == [0, 0], hosts.output(0)[-3000:] + hosts.output(1)[-3000:]
    _report(run, samples, "no delay")
    return run


def test_main_job_runs_as_two_hosts_of_two_ranks(hosts: TwoHosts, uninterrupted: Path) -> None:
    output = hosts.output(0) + hosts.output(1)
    for rank in range(4):
        assert f"rank {rank}:" in output, output[-3000:]
    assert sorted(_losses(uninterrupted)) == list(range(1, STEPS + 1))
    assert (uninterrupted / "ckpt" / "latest").read_text().strip() == f"step{STEPS}"


def test_slow_lossy_link_trains_to_the_same_losses(slow_hosts: TwoHosts, uninterrupted: Path, tmp_path: Path) -> None:
    samples: list[tuple[int, int]] = []
    codes = _train(slow_hosts, tmp_path / "delayed", timeout=200, steps=SLOW_STEPS, samples=samples)
    assert codes == [0, 0], slow_hosts.output(0)[-3000:] + slow_hosts.output(1)[-3000:]
    expected = {step: loss for step, loss in _losses(uninterrupted).items() if step <= SLOW_STEPS}
    assert _losses(tmp_path / "delayed") == expected
    _report(tmp_path / "delayed", samples, "20 ms ± 5 ms, 1% loss")


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
    progress = Progress(lambda: [r.proc.pid for r in hosts.runs], 90)  # a hang guard: steps are what is waited on
    while len(_metrics(run)) < KILL_AFTER and not progress.stalled() and hosts.runs[0].proc.poll() is None:
        time.sleep(0.02)
    assert len(_metrics(run)) >= KILL_AFTER, hosts.output(0)[-3000:]
    hosts.kill_host(1)
    killed_at = time.monotonic()
    codes = hosts.wait(TIMEOUT_S + 30)
    took = time.monotonic() - killed_at
    survivor = hosts.output(0)
    assert codes[0] not in (0, None), survivor[-3000:]
    assert took < TIMEOUT_S + 30
    exits = [line for line in survivor.splitlines() if "exiting with code 1 after Comm" in line]
    assert len(exits) == 2, survivor[-3000:]  # both ranks of the surviving host, each naming its peer
    assert all(" rank " in line and " step=" in line and "node" in line for line in exits), exits
    print(f"host 1 killed: host 0's agent exited {took:.1f} s later; {exits[0]}")
    latest = (run / "ckpt" / "latest").read_text().strip()
    assert latest != f"step{STEPS}", "the job finished before the host was killed"

    codes = _train(hosts, run)
    assert codes == [0, 0], hosts.output(0)[-3000:] + hosts.output(1)[-3000:]
    resumed = hosts.output(0) + hosts.output(1)
    assert f"resumed from checkpoint {latest} at step {latest.removeprefix('step')}" in resumed, resumed[-3000:]
    final, expected = torch.load(run / "final.pt"), torch.load(uninterrupted / "final.pt")
    assert final.keys() == expected.keys()
    assert [name for name in final if not torch.equal(final[name], expected[name])] == []
