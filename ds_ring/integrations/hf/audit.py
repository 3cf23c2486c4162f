"""Nothing silent: a registered model's sequence-mixing modules either run through ds_ring or are refused.

Under sequence parallelism a rank holds a shard of the sequence, so every module that mixes information along
the sequence must see the whole of it. Three checks, each naming the module class, why and what to do:

* :func:`refuse_probed`, at registration of a model instance, by behaviour
  (:func:`~ds_ring.integrations.hf.probe.probe_sequence_mixers`): the modules whose output at one position depends
  on other positions' inputs while the attention interface stands in position-wise. Whatever they are called.
* :func:`refuse_sequence_mixers`, at registration, from the module tree: for the modules the probe did not run or
  read (and for a model given by name or config, built on the meta device: all of them), state-space / Mamba
  mixers, convolutions over time, linear / lightning / delta-rule attention, recurrent blocks and RNNs, recognised
  by their class names (whole, and with the model family's prefix removed) and by their torch types; and position
  embeddings counted past a padding index. A type the user knows to be position-wise is let through with
  ``position_wise=("ClassName", ...)``. The layers of :mod:`ds_ring.integrations.hf.recurrent` pass when
  registration is given the model instance: ds_ring runs them sequence-parallel, their state carried across shards.
* :class:`CallAudit`, while registered: the first forward of every attention module must call ds_ring's
  attention (itself or through a child). One that runs without calling it (its own
  ``F.scaled_dot_product_attention`` or eager code: it attended within the shard) is refused right after that
  forward, before any backward.

:class:`ModelWatch`, on a registered model instance, hands the attention the batch's ``position_ids`` and
documents for models whose attention modules receive no ``**kwargs``.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ds_ring.integrations.hf.probe import Probe
from ds_ring.integrations.hf.watch import ForwardWatch

__all__ = ["computes_attention", "refuse_probed", "refuse_sequence_mixers", "CallAudit", "ModelWatch", "BATCH_KEYS"]

_MIXER = re.compile(
    r"mamba|mixer|ssm|shortconv|conv|lightning|linearattention|lineardecoder|deltanet|deltarule|gateddelta|recurrent|"
    r"rglru|rwkv|lstm|gru|rnn|retention|hyena|xlstm",
    re.IGNORECASE,
)
_POSITION_WISE = re.compile(r"mlp|moe|expert|feedforward|ffn|router|gate$|norm|embedding", re.IGNORECASE)
_STRUCTURE = re.compile(r"(model|forcausallm|lmheadmodel|decoderlayer|decoder|layer|block|stack)$", re.IGNORECASE)
_ATTENTION = re.compile(r"(attention|attn)$", re.IGNORECASE)
_LINEAR_ATTENTION = re.compile(r"(lightning|linear|delta)\w*(attention|attn)$", re.IGNORECASE)
"""Attention-named modules that are recurrences (MiniMax's lightning, Kimi's delta attention)."""

BATCH_KEYS = ("position_ids", "ds_ring_cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k")
"""The model call's keyword arguments the attention may need: passed on for attention modules that get none."""


def _family_prefix(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    return type(config).__name__.removesuffix("Config") if config is not None else ""


def _short_name(module: nn.Module, prefix: str) -> str:
    name = type(module).__name__
    return name[len(prefix) :] if prefix and name.lower().startswith(prefix.lower()) and name != prefix else name


def _named_mixer(name: str) -> bool:
    """A class name that says sequence mixer (and not a container, a position-wise layer or softmax attention)."""
    mixer_named = bool(_MIXER.search(name)) and not any(
        pattern.search(name) for pattern in (_POSITION_WISE, _STRUCTURE, _ATTENTION)
    )
    return mixer_named or bool(_LINEAR_ATTENTION.search(name))


def _mixes_over_time(module: nn.Module) -> bool:
    """A torch layer that mixes neighbouring positions: a convolution wider than 1, or a recurrent net."""
    if isinstance(module, nn.RNNBase):
        return True
    return isinstance(module, nn.Conv1d | nn.Conv2d | nn.Conv3d) and max(module.kernel_size) > 1


def computes_attention(class_name: str) -> bool:
    """Whether a class name says softmax attention (``...Attention`` / ``...Attn``, not a linear one)."""
    return bool(_ATTENTION.search(class_name)) and not _LINEAR_ATTENTION.search(class_name)


def refuse_probed(probe: Probe) -> None:
    """``ValueError`` naming the first module the probe found mixing along the sequence by itself."""
    if not probe.mixers:
        return
    mixer = probe.mixers[0]
    cls = type(mixer.module).__name__
    seen = (
        f"its output at one position depends on the inputs at other positions while transformers' attention "
        f"interface stands in position-wise (a probe forward of {probe.tokens} tokens at registration)"
    )
    if computes_attention(cls):
        raise ValueError(
            f"{mixer.describe()} computes attention in its own code (e.g. F.scaled_dot_product_attention or eager "
            f"code, ignoring attn_implementation), not through transformers' attention interface: {seen}. On one "
            f"rank's shard it would attend only within that shard. ds_ring cannot run this model sequence-parallel; "
            f"train it without sequence parallelism, or use a model whose attention goes through transformers' "
            f"attention interface"
        )
    declare = cls if mixer.owner is None else mixer.owner
    raise ValueError(
        f"{mixer.describe()} mixes information along the sequence other than through attention: {seen}. Run on "
        f"one rank's shard it would restart at every shard boundary, so ds_ring refuses it. Train this model "
        f"without sequence parallelism (register_with_transformers(..., position_wise=[{declare!r}]) lets it "
        f"through, which is right only if the dependency measured is not along the sequence)"
    )


def refuse_sequence_mixers(
    model: nn.Module,
    position_wise: Iterable[str] = (),
    handled: Iterable[nn.Module] = (),
    probed: Iterable[nn.Module] = (),
) -> None:
    """``ValueError`` naming the first module that mixes along the sequence other than through attention.

    Args:
        model: the model (its module tree is read; nothing runs).
        position_wise: class names the user declares position-wise (mixing nothing along the sequence).
        handled: modules ds_ring runs sequence-parallel itself (:mod:`ds_ring.integrations.hf.recurrent`): they and
            their children pass.
        probed: modules whose behaviour the probe read (:func:`refuse_probed` judges them): their names are not
            held against them.
    """
    from ds_ring.integrations.hf.recurrent import supported_mixer

    allowed = set(position_wise)
    prefix = _family_prefix(model)
    inside = {id(m) for mixer in handled for m in mixer.modules()}
    read = {id(m) for m in probed}
    for path, module in model.named_modules():
        cls = type(module).__name__
        if cls in allowed or module is model or id(module) in inside:
            continue
        # the whole name too: a family prefix can carry the meaning (xLSTMBackend is "Backend" without it)
        named = _named_mixer(_short_name(module, prefix)) or _named_mixer(cls)
        if type(module).__module__.startswith("transformers.pytorch_utils"):  # Conv1D is GPT-2's linear layer
            named = False
        position = "position" in path.rsplit(".", 1)[-1]
        if isinstance(module, nn.Embedding) and position and module.padding_idx is not None:
            raise ValueError(
                f"{cls} (at {path}) is a position embedding with padding_idx {module.padding_idx}: the model counts "
                f"positions from input_ids past its padding index (RoBERTa-style), while shard_batch gives every "
                f"token its position from 0; ds_ring refuses it rather than shift every position. Train this model "
                f"without sequence parallelism"
            )
        if id(module) in read:
            continue
        if named or _mixes_over_time(module):
            owner = next((m for p, m in model.named_modules() if path.startswith(f"{p}.") and supported_mixer(m)), None)
            if supported_mixer(module) or owner is not None:
                mixer = type(owner if owner is not None else module).__name__
                raise ValueError(
                    f"{mixer} (at {path}) mixes information along the sequence other than through attention; ds_ring "
                    f"runs it sequence-parallel only when register_with_transformers is given the model instance "
                    f"(it was given a config or a name): pass the model"
                )
            raise ValueError(
                f"{cls} (at {path or 'the model'}) mixes information along the sequence other than through "
                f"attention (a state-space / recurrent / convolution / linear-attention layer): run on one rank's "
                f"shard it would restart at every shard boundary, so ds_ring refuses it. Train this model without "
                f"sequence parallelism, or, if {cls} is position-wise (mixes nothing along the sequence), declare it: "
                f"register_with_transformers(..., position_wise=[{cls!r}])"
            )


class CallAudit:
    """While installed: the first forward of every attention module (class name ending in ``Attention`` or
    ``Attn``) must call ds_ring's attention, itself or through a child, else ``ValueError`` right after that
    forward (before any backward). Process-wide module hooks (any model a registered implementation could serve);
    after a module's first forward its hooks cost one set lookup. ``exempt``: ids of modules that run whole, not on
    the sharded sequence (a vision-language model's vision tower: :mod:`~ds_ring.integrations.hf.vision`)."""

    def __init__(self, exempt: Iterable[int] = ()) -> None:
        self._audited: set[int] = set(exempt)
        self._open: list[list] = []  # [id(module), whether it called ds_ring's attention] of the open first forwards
        self._handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(self._enter),
            torch.nn.modules.module.register_module_forward_hook(self._leave, always_call=True),
        ]

    def attended(self, _module: nn.Module) -> None:
        """Called by ds_ring's attention on every call (no counter: under ``torch.compile`` a number that changes
        every step would be a guard that fails every step, recompiling the model each time)."""
        for entry in self._open:
            entry[1] = True

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _enter(self, module: nn.Module, _args: Any) -> None:
        if id(module) not in self._audited and _ATTENTION.search(type(module).__name__):
            from ds_ring.integrations.hf.recurrent import supported_mixer

            if supported_mixer(module):  # a recurrence named attention, run sequence-parallel by ds_ring itself
                self._done(module)
                return
            self._open.append([id(module), False])

    def _done(self, module: nn.Module) -> None:
        # while compiling: checked again in every trace (free when the graph runs) rather than remembered, so the
        # set the compiler guards on stays the same from step to step
        if not torch.compiler.is_compiling():
            self._audited.add(id(module))

    def _leave(self, module: nn.Module, _args: Any, _out: Any) -> None:
        if not self._open or self._open[-1][0] != id(module):
            return
        _, attended = self._open.pop()
        self._done(module)
        if attended:
            return
        refusal = ValueError(
            f"{type(module).__name__} ran without calling ds_ring's attention: it computes attention in its own "
            f"code (e.g. F.scaled_dot_product_attention or eager code, ignoring attn_implementation); on one "
            f"rank's shard it attends only within that shard. ds_ring cannot run this model sequence-parallel; "
            f"train it without sequence parallelism, or use a model whose attention goes through transformers' "
            f"attention interface"
        )
        failed = sys.exc_info()[1]
        if _out is None and failed is not None:
            # the forward raised: torch runs this hook inside its except block and would silence (warn about) a
            # raise here, re-raising the forward's error; that error carries ds_ring's reason instead
            failed.add_note(f"ds_ring: {refusal}")
            return
        raise refusal


class ModelWatch(ForwardWatch):
    """A forward pre-hook on the registered model instance: ``batch`` holds, while its forward runs, the call's
    :data:`BATCH_KEYS`, for attention modules that receive no ``**kwargs`` (a vision-language model's language model
    gets this rank's positions from its cut instead: :attr:`~ds_ring.integrations.hf.vision.VisionLanguage.batch`)."""

    def __init__(self, model: nn.Module) -> None:
        self.batch: Mapping[str, Any] = {}
        super().__init__(model)

    def _enter(self, _module: nn.Module, _args: tuple, kwargs: Mapping[str, Any]) -> None:
        self.batch = {key: kwargs[key] for key in BATCH_KEYS if kwargs.get(key) is not None}

    def _leave(self, _module: nn.Module, _args: Any, _out: Any) -> None:
        self.batch = {}
