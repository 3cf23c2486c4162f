"""DeepSpeed's ``test_tiled_compute.py`` (ALST's tiled compute), ported: only the import changed.

``from ds_ring.integrations.hf import TiledMLP, TiledFusedLogitsLoss, sequence_tiled_compute`` in place of
DeepSpeed's ``ulysses_sp``; the original's model (two ReLU MLPs and an LM head), its lengths (125 and 425
tokens: a shorter last tile), batch sizes 1 and 2, ZeRO 2 and 3, its ``Adam`` block (``torch_adam``: no
compiled op on CPU), fp32 on 2 gloo ranks (the original runs 1 rank; 2 make ZeRO partition). Asserted as the
original does: the tiled model's loss equals the plain model's exactly (``TiledMLP``, ``sequence_tiled_compute``)
or closely (``TiledFusedLogitsLoss``), the weights' and the input's gradients are close, and the backward warns
of no gradient layout problem. Added: the same in float64 without an engine to 1e-12, where ALST's
mean-of-tile-means would be off for 425 tokens in 2 tiles; the reductions of ``sequence_tiled_compute``; and
the argument errors.
"""

import copy
import os
import warnings

import pytest
import torch
from torch.nn import Linear, Module

from tests.dist import CaseLog, assert_no_failures, run_distributed


class SimpleMLP(Module):
    def __init__(self, hidden_dim: int) -> None:
        super().__init__()
        self.up_proj = Linear(hidden_dim, hidden_dim * 2, bias=False)
        self.down_proj = Linear(hidden_dim * 2, hidden_dim, bias=False)
        self.act = torch.nn.ReLU()

    def forward(self, x):
        return self.down_proj(self.act(self.up_proj(x)))


mlp_forward_orig = SimpleMLP.forward


class MyModel(Module):
    """Two MLPs (the second's backward must hand the first the right gradient) and an LM head."""

    def __init__(self, hidden_dim: int, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.mlp1 = SimpleMLP(hidden_dim)
        self.mlp2 = SimpleMLP(hidden_dim)
        self.lm_head = Linear(hidden_dim, vocab_size, bias=False)
        self.cross_entropy_loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, y):
        x = self.mlp2(self.mlp1(x))
        return self.cross_entropy_loss(self.lm_head(x).view(-1, self.vocab_size), y.view(-1))


def mlp_forward_tiled_mlp(self, x):
    from ds_ring.integrations.hf import TiledMLP

    return TiledMLP.apply(mlp_forward_orig, self, x, 4, [self.down_proj.weight, self.up_proj.weight])


def mlp_forward_sequence_tiled_compute(self, x):
    from ds_ring.integrations.hf import sequence_tiled_compute

    return sequence_tiled_compute(
        mlp_forward_orig, x.shape[1], 4, dict(x=x), dict(self=self), "x",
        [self.down_proj.weight, self.up_proj.weight], output_unshard_dimension=1, output_reduction=None,
    )  # fmt: skip


def tiled_forward(self, x, y):
    from ds_ring.integrations.hf import TiledFusedLogitsLoss

    x = self.mlp2(self.mlp1(x))

    def loss_fn(self, x, y):
        return self.cross_entropy_loss(self.lm_head(x).view(-1, self.vocab_size), y.view(-1))

    return TiledFusedLogitsLoss.apply(loss_fn, self, x, y, None, 2, [self.lm_head.weight], "mean")


def _config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "steps_per_print": 10**9,
    }


def _run(stage: int, forwards: dict, x: torch.Tensor, y: torch.Tensor, seed: int, hidden: int, vocab: int):
    """The engine's loss, the named weights' full gradients, x's gradient, and the backward's warnings."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    saved = {cls: cls.forward for cls in forwards}
    for cls, forward in forwards.items():
        cls.forward = forward
    try:
        torch.manual_seed(seed)
        model = MyModel(hidden_dim=hidden, vocab_size=vocab)
        engine, *_ = deepspeed.initialize(config=_config(stage), model=model, model_parameters=model.parameters())
        x = x.clone().detach().requires_grad_(True)
        loss = engine(x, y)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.backward(loss)
        module = engine.module
        named = (module.mlp1.up_proj.weight, module.mlp2.up_proj.weight, module.lm_head.weight)
        grads = [copy.deepcopy(safe_get_full_grad(p)) for p in named]
        engine.destroy()
    finally:
        for cls, forward in saved.items():
            cls.forward = forward
    return loss.detach(), grads, x.grad, [str(w.message) for w in caught]


def _check_engines(log: CaseLog) -> None:
    cases = {
        "TiledMLP": ({SimpleMLP: mlp_forward_tiled_mlp}, 10, 128, 125, True),
        "sequence_tiled_compute": ({SimpleMLP: mlp_forward_sequence_tiled_compute}, 10, 128, 125, True),
        "TiledFusedLogitsLoss": ({MyModel: tiled_forward}, 100, 64, 425, False),
    }
    for stage in (2, 3):
        for batch_size in (1, 2):
            for name, (forwards, vocab, hidden, seqlen, exact_loss) in cases.items():
                with log.case(f"{name}, ZeRO {stage}, batch size {batch_size}: the plain model's loss and gradients"):
                    torch.manual_seed(42)
                    x = torch.rand((batch_size, seqlen, hidden))
                    y = torch.empty((batch_size, seqlen), dtype=torch.long).random_(vocab)
                    loss_a, grads_a, x_grad_a, _ = _run(stage, {}, x, y, 42, hidden, vocab)
                    loss_b, grads_b, x_grad_b, warned = _run(stage, forwards, x, y, 42, hidden, vocab)
                    assert not [w for w in warned if "gradient layout contract" in w], warned
                    if exact_loss:
                        torch.testing.assert_close(loss_b, loss_a, rtol=0.0, atol=0.0)
                    else:
                        torch.testing.assert_close(loss_b, loss_a)
                    assert all(g is not None for g in grads_b) and x_grad_b is not None
                    checked = grads_b[:2] if exact_loss else grads_b[2:]
                    for got, want in zip(checked, grads_a[:2] if exact_loss else grads_a[2:], strict=True):
                        torch.testing.assert_close(got, want)
                    torch.testing.assert_close(x_grad_b, x_grad_a)


def _float64_case(forwards: dict, vocab: int, hidden: int, seqlen: int, batch_size: int):
    """(loss, every weight's gradient, x's gradient) of MyModel in float64 without an engine."""
    saved = {cls: cls.forward for cls in forwards}
    for cls, forward in forwards.items():
        cls.forward = forward
    try:
        torch.manual_seed(7)
        model = MyModel(hidden_dim=hidden, vocab_size=vocab).double()
        x = torch.rand((batch_size, seqlen, hidden), dtype=torch.float64, requires_grad=True)
        y = torch.empty((batch_size, seqlen), dtype=torch.long).random_(vocab)
        loss = model(x, y)
        loss.backward()
    finally:
        for cls, forward in saved.items():
            cls.forward = forward
    return loss.detach(), [p.grad for p in model.parameters()], x.grad


def _check_float64(log: CaseLog) -> None:
    for name, forwards in (
        ("TiledMLP", {SimpleMLP: mlp_forward_tiled_mlp}),
        ("sequence_tiled_compute", {SimpleMLP: mlp_forward_sequence_tiled_compute}),
        ("TiledFusedLogitsLoss (425 tokens, 2 tiles of 213 and 212: token-weighted mean)", {MyModel: tiled_forward}),
    ):
        with log.case(f"{name}, float64, no engine: the plain model's loss and every gradient to 1e-12"):
            want = _float64_case({}, 50, 32, 425, 1)
            got = _float64_case(forwards, 50, 32, 425, 1)
            torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=0.0)
            for g, w in zip([*got[1], got[2]], [*want[1], want[2]], strict=True):
                torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)


def _check_reductions_and_errors(log: CaseLog) -> None:
    from ds_ring.integrations.hf import TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute

    torch.manual_seed(3)
    mlp = SimpleMLP(8).double()
    x = torch.rand((2, 11, 8), dtype=torch.float64)
    with log.case("sequence_tiled_compute: 'mean' and 'sum' of the joined output, exact gradients"):
        for reduction in ("mean", "sum"):
            a = x.clone().requires_grad_(True)
            want = getattr(mlp(a), reduction)()
            want.backward()
            b = x.clone().requires_grad_(True)
            got = sequence_tiled_compute(mlp_forward_orig, 11, 3, {"x": b}, {"self": mlp}, "x", None, 1, reduction)
            got.backward()
            torch.testing.assert_close(got, want, rtol=1e-12, atol=0.0)
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-15)
    errors = [
        ("output_reduction must be None, 'mean' or 'sum'",
         lambda: sequence_tiled_compute(mlp_forward_orig, 11, 3, {"x": x}, {"self": mlp}, "x", None, 1, "max")),
        ("grad_requiring_tensor_key 'h' is not a key of kwargs_to_shard",
         lambda: sequence_tiled_compute(mlp_forward_orig, 11, 3, {"x": x}, {"self": mlp}, "h")),
        (r"kwargs_to_shard\['x'\] must be a \[batch, seqlen=12",
         lambda: sequence_tiled_compute(mlp_forward_orig, 12, 3, {"x": x}, {"self": mlp}, "x")),
        ("number of tiles \\(shards\\) must be an integer >= 1, got 0",
         lambda: TiledMLP.apply(mlp_forward_orig, mlp, x, 0, None)),
        ("output_reduction must be 'mean' or 'sum'",
         lambda: TiledFusedLogitsLoss.apply(None, mlp, x, x[..., 0], None, 2, None, None)),
        ("x and y must be \\[batch, seq, ...\\] with the same batch and seq",
         lambda: TiledFusedLogitsLoss.apply(None, mlp, x, x[:, :3, 0], None, 2, None, "sum")),
    ]  # fmt: skip
    for match, call in errors:
        with log.case(f"refused: {match}"), pytest.raises(ValueError, match=match):
            call()


def _rank(rank: int, world: int) -> list[str]:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    log = CaseLog()
    _check_float64(log)
    _check_reductions_and_errors(log)
    _check_engines(log)
    return log.failures


@pytest.mark.timeout(960)
def test_alst_tiled_compute_ported():
    assert_no_failures(run_distributed(_rank, 2, timeout=900))
