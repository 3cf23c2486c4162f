"""``python -m benchmarks.trainer``: tokens/s of ``SequenceParallelTrainer`` vs the hand-written loop, same job, the
two alternated round by round (``benchmarks/SUITE.md``); prints the median of the per-round ratios Trainer ÷ loop."""

import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.common import ROOT, figure, rel, script_args, write_json

JOBS = {
    "hand-written loop": ("launch/train_hf.py", "ds_configs/hf_ring.json", r"rank 0:\s+(\d+) tokens/s"),
    "SequenceParallelTrainer": ("launch/train_trainer.py", "ds_configs/hf_trainer.json", r"\((\d+) tokens/s\)"),
}


def tokens_per_s(script: str, config: str, pattern: str, steps: int, seq: int) -> float:
    """One job under torchrun (2 ranks on this host, a free port), its tokens/s as the script prints it."""
    command = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2", script,
               "--deepspeed_config", config, "--steps", str(steps), "--seq", str(seq)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    found = re.search(pattern, done.stdout)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"{script} failed:\n{done.stdout[-3000:]}")
    return float(found.group(1))


def main() -> None:
    flags = (("--rounds", 4), ("--steps", 30), ("--seq", 2048))
    args = script_args(__doc__, *((f, {"type": int, "default": d}) for f, d in flags), timeout_s=None)
    rounds = []
    for r in range(args.rounds):
        rounds.append({name: tokens_per_s(*job, args.steps, args.seq) for name, job in JOBS.items()})
        rounds[-1]["load"] = os.getloadavg()[0]
        print(f"round {r + 1}: " + ", ".join(f"{k} {v:.0f}" for k, v in rounds[-1].items()), flush=True)
    ratios = [row["SequenceParallelTrainer"] / row["hand-written loop"] for row in rounds]
    summary = {name: statistics.median(row[name] for row in rounds) for name in JOBS}
    summary["median ratio Trainer / loop"] = statistics.median(ratios)
    result = {"settings": vars(args) | {"out": rel(args.out)}, "rounds": rounds, "ratios": ratios, "summary": summary}
    write_json(args.out / "trainer.json", result)
    with figure(args.out / "trainer_tokens.png", 6, 3.5) as (ax,):
        for name in JOBS:
            ax.plot(range(1, len(rounds) + 1), [row[name] for row in rounds], marker="o", label=name)
        ax.set(xlabel="round (alternated)", ylabel="tokens/s (2 CPU ranks)", title="Trainer vs hand-written loop")
        ax.set_ylim(bottom=0)
        ax.legend()
    print(summary)


if __name__ == "__main__":
    main()
