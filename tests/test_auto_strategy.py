"""``strategy="auto"``: equals the float64 oracle (it runs one valid strategy), decides alike on every rank even
when the probe measures differently per rank, never picks what a strategy refuses; ``python -m ds_ring.auto``."""

import functools
import io
import json
from contextlib import redirect_stdout

import pytest

from ds_ring.auto.model import Link, Problem, choose, plan_options
from tests.dist import run_distributed
from tests.sharded_cases import run_cases

L = 8  # rows per rank


def _skewed(rank_scale: float, bound: str):
    """A ``measure_link`` replacement: every rank measures a different link (``rank_scale`` per rank), latency-bound
    (few messages win: a ring) or bandwidth-bound (few bytes win: Ulysses or hybrid where the heads allow)."""

    def measure(group, device, timeout_s=None):
        import torch.distributed as dist

        r = dist.get_rank()
        latency, bandwidth = (1e-3, 1e12) if bound == "latency" else (1e-12, 1e3)
        return Link(latency_s=latency * (1 + rank_scale * r), bandwidth=bandwidth / (1 + rank_scale * r),
                    flops=1e10 * (1 + r), source="test")  # fmt: skip

    return measure


def _cases(world: int) -> list[dict]:
    seq = world * L
    base = dict(batch=1, seq=seq, head_dim=4, dtype="float64", head_offset=0, layout="contiguous", communication=None)
    heads = [(4, 4), (4, 1), (6, 2)] if world == 2 else [(4, 4), (8, 2), (6, 3)]  # 6 heads: no Ulysses at 4 ranks
    branches = [(None, None), ([L // 2, 2 * L, seq], [1, 2, 4])]
    cases = []
    for i, ((h, hkv), (segs, rates)) in enumerate((hh, bb) for hh in heads for bb in branches):
        cases.append(dict(base, heads=h, kv_heads=hkv, segments=segs, rates=rates, causal=i % 2 == 0, seed=i))
    cases.append(dict(base, heads=4, kv_heads=2, segments=None, rates=None, causal=True, layout="zigzag", seed=50))
    return cases


def _rank(rank: int, world: int, ulysses: int, ring: int, skew: float, bound: str) -> tuple[list[str], list[str]]:
    import ds_ring
    from ds_ring.auto import probe, strategy

    probe.measure_link = _skewed(skew, bound)
    topology = ds_ring.Topology(ulysses=ulysses, ring=ring)
    attention = functools.partial(ds_ring.sequence_parallel_attention, topology=topology, strategy="auto")
    failures = run_cases(_cases(world), attention, group=topology.sequence_parallel_group)
    plain = functools.partial(ds_ring.ring_dilated_attention, strategy="auto")  # a plain group: 1 × world
    failures += run_cases(_cases(world)[:3], plain)
    return failures, [o.label for o in strategy.decisions()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("ulysses", "ring", "bound"),
    [(1, 2, "latency"), (2, 1, "bandwidth"), (2, 2, "bandwidth"), (1, 4, "latency"), (1, 4, "bandwidth")],
    ids=["r2-latency", "u2-bandwidth", "u2xr2-bandwidth", "r4-latency", "r4-bandwidth"],
)
def test_auto_matches_reference_and_agrees(ulysses, ring, bound):
    """Forward+backward fp64 equal the oracle; every rank made the same choices although each measured its
    own link (latency, bandwidth and FLOP rate differ by rank); a latency-bound link picks rings, a
    bandwidth-bound one the all-to-all strategies where the heads allow (so both paths run through auto)."""
    world = ulysses * ring
    results = run_distributed(_rank, world, timeout=110, ulysses=ulysses, ring=ring, skew=3.0, bound=bound)
    failures = [f for per_rank, _ in results for f in per_rank]
    assert not failures, "\n".join(failures[:3])
    choices = [labels for _, labels in results]
    assert choices[0], "auto made no decision"
    assert all(labels == choices[0] for labels in choices), choices
    picked = {label.split()[0].split("/")[0] for label in choices[0]}
    if bound == "latency":
        assert picked <= {"ring", "allgather"}, picked
    else:
        assert picked & {"ulysses", "hybrid"}, picked


def test_never_invalid():
    """Options a strategy refuses are never chosen: heads that do not split, zigzag with dilation."""
    fast_link = Link(latency_s=1e-9, bandwidth=1e15, flops=1e12)
    for heads, kv in [(6, 2), (6, 6), (5, 5), (3, 1)]:
        p = Problem(seq=4096, heads=heads, kv_heads=kv, head_dim=64, world=4)
        options = plan_options(p, fast_link)
        best = choose(p, fast_link)
        assert best.error is None
        assert best.strategy != "ulysses"
        assert all(o.error is not None for o in options if o.strategy == "ulysses")
        assert all(o.error is not None for o in options if o.strategy == "hybrid" and heads % o.ulysses)
    dilated = Problem(seq=4096, heads=8, kv_heads=8, head_dim=64, world=4, segment_lengths=(512, 4096),
                      dilation_rates=(1, 4))  # fmt: skip
    for o in plan_options(dilated, fast_link):
        if o.error is None:
            assert not (o.layout == "zigzag" and o.strategy in ("ring", "allgather")), o
    with pytest.raises(ValueError, match="no valid strategy"):
        choose(Problem(seq=4095, heads=8, kv_heads=8, head_dim=64, world=4), fast_link)


def test_choice_follows_the_link():
    """Compute slow enough to hide a ring's transfers: a ring; compute too fast to hide anything: the option
    that sends the fewest bytes; the choice is a pure function of its inputs."""
    p = Problem(seq=2**16, heads=8, kv_heads=8, head_dim=64, world=4, layouts=("zigzag",))
    hidden = Link(latency_s=1e-4, bandwidth=1e9, flops=1e11)
    assert choose(p, hidden).strategy == "ring"
    assert choose(p, hidden) == choose(p, hidden)
    exposed = Link(latency_s=1e-4, bandwidth=1e8, flops=1e15)
    options = plan_options(p, exposed)
    assert options[0].sent_bytes == min(o.sent_bytes for o in options if o.error is None)
    gqa = Problem(seq=2**16, heads=32, kv_heads=32, head_dim=128, world=4, layouts=("contiguous",))
    best = choose(gqa, Link(latency_s=1e-6, bandwidth=1e12, flops=1e14))
    assert best.strategy in ("ulysses", "hybrid")  # contiguous causal rings idle; Ulysses is balanced


def test_plan_cli_prints_table(tmp_path):
    from ds_ring.auto import cli as plan

    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"ring_attention": {"strategy": "auto", "causal": True}}))
    out = io.StringIO()
    with redirect_stdout(out):
        code = plan.main(["--config", str(config), "--seq", "65536", "--heads", "6", "--kv-heads", "2",
                          "--head-dim", "64", "--world", "4"])  # fmt: skip
    text = out.getvalue()
    assert code == 0
    assert "choice: strategy" in text and "q-shards" in text and "MiB" in text
    assert "refused" in text  # 6 heads over 4 ranks: no Ulysses
    out = io.StringIO()
    with redirect_stdout(out):
        plan.main(["--seq", "8192", "--heads", "8", "--head-dim", "64", "--world", "2", "--json"])
    rows = json.loads(out.getvalue())["options"]
    assert rows and all("memory_bytes" in r and "time_s" in r for r in rows)


def test_config_accepts_auto():
    from ds_ring.config import RingAttentionConfig

    section = RingAttentionConfig(strategy="auto")
    section.check(world_size=4, num_heads=6, num_kv_heads=2, seq_len=64)
    with pytest.raises(ValueError, match="no valid strategy"):
        RingAttentionConfig(strategy="auto", layout="zigzag", segment_lengths=[8, 64], dilation_rates=[1, 2]).check(
            world_size=4, num_heads=6, num_kv_heads=2, seq_len=64
        )


def test_the_old_command_name_still_runs_and_names_the_new_one():
    import subprocess
    import sys

    args = ["--seq", "8192", "--heads", "8", "--head-dim", "64", "--world", "2", "--json"]
    done = subprocess.run([sys.executable, "-m", "ds_ring.plan", *args], capture_output=True, text=True, check=True)
    assert json.loads(done.stdout)["options"]
    assert "python -m ds_ring.auto" in done.stderr
