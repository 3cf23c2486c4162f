"""Position modules that number a shard's tokens themselves, ignoring ``position_ids``: found by what they do.

Under sequence parallelism a rank holds a shard of the sequence, and :func:`~ds_ring.integrations.hf.shard_batch`
gives each of its tokens its place in the whole sequence as ``position_ids``. A model whose position embedding
numbers the tokens it is given from 0 (the decoders of BART, mBART, Marian, Pegasus, PLBart, Blenderbot and
MusicGen build ``arange(length)`` whatever ``position_ids`` say) embeds every shard as if it started the sequence:
every rank but the first trains on wrong positions, silently.

:func:`refuse_position_blind` runs the model twice at registration (eval mode, no gradients, a few random tokens,
the attention transformers would use): ``position_ids = 0 .. n-1``, then the same with the second half moved
:data:`JUMP` places on. Every module that is a position embedding by its class (``...PositionalEmbedding``,
``...PositionEmbedding``, ``...RotaryEmbedding``) or an ``nn.Embedding`` held under a name with ``position`` in it
must give another output the second time; one that gives the same output did not read the ``position_ids``.
A model without such modules (Mamba, Jamba: order comes from their recurrences) is not judged here.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["refuse_position_blind", "JUMP", "POSITION_TOKENS"]

JUMP = 8
"""How far the second run moves the second half's ``position_ids`` on."""
POSITION_TOKENS = 64
"""Most tokens of the two forwards: they run the model's own attention (a ``[length, length]`` mask and scores)."""

_POSITION_CLASS = re.compile(r"rotary|position(al)?embedding", re.IGNORECASE)


def _position_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for path, module in model.named_modules():
        attribute = path.rsplit(".", 1)[-1].lower()
        if _POSITION_CLASS.search(type(module).__name__) or (
            isinstance(module, nn.Embedding) and "position" in attribute
        ):
            yield path, module


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, tuple | list):
        return [t for item in output for t in _tensors(item)]
    return []


@contextlib.contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """Every module in eval mode while open; each module's own mode back after."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def refuse_position_blind(model: nn.Module, length: int, vocab: int) -> str | None:
    """``ValueError`` naming the first position module whose output ignores ``position_ids``.

    Args:
        model: a transformers model instance whose parameters can run here (not on the meta device, not partitioned
            by ZeRO 3); its state is left as it was.
        length: tokens of the two forwards (the probe's length: a multiple of the config's chunk sizes).
        vocab: the vocabulary to draw the tokens from.

    Returns:
        ``None`` when the check ran (and found nothing), else why it could not run (the caller says so).
    """
    modules = list(_position_modules(model))
    if not modules:
        return None
    parameters = inspect.signature(model.forward).parameters
    if "position_ids" not in parameters and not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return "its forward takes no position_ids"
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    tokens = torch.randint(min(3, vocab - 1), vocab, (1, length), generator=torch.Generator().manual_seed(1))
    tokens = tokens.to(device)
    positions = torch.arange(length, device=device)[None]
    moved = positions.clone()
    moved[:, length // 2 :] += JUMP
    outputs: dict[int, list[list[torch.Tensor]]] = {id(m): [] for _, m in modules}

    def record(module: nn.Module, _args: Any, output: Any) -> None:
        outputs[id(module)].append([t.detach().clone() for t in _tensors(output)])

    handles = [module.register_forward_hook(record) for _, module in modules]
    kwargs = {"use_cache": False} if "use_cache" in parameters else {}
    try:
        with _evaluating(model), torch.no_grad():
            model(input_ids=tokens, position_ids=positions, **kwargs)
            runs = {key: len(value) for key, value in outputs.items()}
            model(input_ids=tokens, position_ids=moved, **kwargs)
    except Exception as err:  # noqa: BLE001 - the check cannot run on this model: the caller warns
        return f"its forward raised {type(err).__name__}: {str(err)[:200]}"
    finally:
        for handle in handles:
            handle.remove()
    for path, module in modules:
        calls = outputs[id(module)]
        first, second = calls[: runs[id(module)]], calls[runs[id(module)] :]
        if not first or len(first) != len(second):
            continue  # not called, or called differently: nothing to compare
        if all(
            len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b, strict=True))
            for a, b in zip(first, second, strict=True)
        ):
            raise ValueError(
                f"{type(module).__name__} (at {path}) computes positions from the shard's own token index, not from "
                f"the position_ids the batch gives (a forward at registration gave the same output for position_ids "
                f"0..{length - 1} and for its second half moved {JUMP} places on): under sequence parallelism every "
                f"rank but the first would embed its tokens at the wrong positions. ds_ring cannot run this model "
                f"sequence-parallel; train it without sequence parallelism"
            )
    return None
