"""transformers' causal-LM zoo under ds_ring: every family built tiny, trained one step sequence-parallel.

Each family in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` is built from its default config made tiny (2 layers,
hidden 64, 4 heads / 2 K/V heads, vocab 128, sliding windows of 16 tokens: shorter than one rank's shard; per-family
sizes in :data:`OVERRIDES` / :data:`CONSTRUCTED`), random weights, float64 throughout (:class:`Float64Throughout`),
dropout off. The reference is the whole model on one process with ``eager`` attention (the model's own masks,
windows, sinks and soft-capping); ds_ring runs it registered (:func:`register_with_transformers`), on batches from
:func:`shard_batch`, with :func:`causal_lm_loss`. A family is *equal* when the loss and each parameter's gradient
(summed over the sequence group) match the reference to :data:`TOLERANCE` of that parameter's own scale
(:func:`worst_error`), *refused* when ds_ring raises a ``ValueError`` naming why, *wrong* otherwise, *no reference*
when the whole model fails too, and *crash* on any other exception. Families that do not build tiny here are listed
with the reason (:func:`build_failures`).

``python -m tests.zoo`` runs the zoo on 2 ranks and writes ``docs/model_zoo.md`` (the table the docs show);
``tests/test_model_zoo.py`` runs the same code and checks the outcomes against :data:`EXPECTED_REFUSALS`.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import math
import re
import time
import traceback
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

SEQ, BATCH, VOCAB, WINDOW = 64, 2, 128, 16
DS_RING = Path(__file__).resolve().parents[1] / "ds_ring"
"""ds_ring's package: a ``ValueError`` raised in it is a refusal; one raised in a model's code is not."""
MAX_PARAMETERS = 10_000_000
"""A family whose tiny config still has more parameters than this is listed as not tiny."""

SIZES: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=4 * SEQ, sliding_window=WINDOW, use_cache=False,
    num_experts=4, n_routed_experts=4, num_local_experts=4, moe_intermediate_size=32, num_experts_per_tok=2,
    shared_expert_intermediate_size=32, ffn_hidden_size=128, n_embd=64, n_layer=2, n_head=4, d_model=64,
    n_positions=4 * SEQ, num_layers=2, num_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=8, v_head_dim=16, qk_head_dim=24,
    rotary_dim=8, n_ctx=4 * SEQ, lru_width=64, attention_window_size=WINDOW, attention_hidden_size=128,
    attention_head_dim=16, mamba_dt_rank=8, linear_head_dim=16, first_k_dense_replace=1, n_shared_experts=1,
    n_group=1, topk_group=1, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=128, decoder_ffn_dim=128,
    encoder_attention_heads=4, decoder_attention_heads=4,
)  # fmt: skip
"""Fields set on a family's (text) config where it has them."""

SSD = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=8, mamba_expand=2,
           num_heads=8, head_dim=16, n_groups=2, state_size=16, chunk_size=8, expand=2)  # fmt: skip
"""Mamba2 mixers that fit a hidden size of 64 (8 heads × 16 = 2 × 64), with scan chunks of 8 tokens."""

_GEMMA4 = dict(global_head_dim=16, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16)
_DOTS3 = dict(num_key_value_heads=4, pyramid_num_routed=[-1, 4])  # routed experts per layer: a dense, a sparse one
_NO_PER_LAYER_INPUT = dict(vocab_size_per_layer_input=0, hidden_size_per_layer_input=0)  # assistants have none

OVERRIDES: dict[str, dict[str, Any]] = {
    "bamba": {**SSD, "attn_layer_indices": [1]},
    "granitemoehybrid": {**SSD, "layer_types": ["mamba", "attention"]},
    "mamba2": SSD,
    "zamba2": {"layers_block_type": ["mamba", "hybrid"], "n_mamba_heads": 8, "mamba_expand": 2, "mamba_ngroups": 2,
               "mamba_d_state": 16, "chunk_size": 8},
    "xlstm": {"embedding_dim": 64, "num_heads": 4, "num_blocks": 2, "chunk_size": 16, "mode": "train",
              "autocast_kernel_dtype": "float32", "inference_state_dtype": "float32"},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "gemma3n_text": {"num_kv_shared_layers": 0, "layer_types": ["sliding_attention", "full_attention"],
                     "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16,
                     "laurel_rank": 8, "altup_num_inputs": 4, "activation_sparsity_pattern": [0.0, 0.0]},
    "gemma4_text": _GEMMA4,
    "gemma4": {"text_config": _GEMMA4},
    "gemma4_unified_text": _GEMMA4,
    "gemma4_unified": {"text_config": _GEMMA4, "vision_config": {"mm_embed_dim": 64, "mm_posemb_size": 16,
                                                                 "output_proj_dims": 64, "patch_size": 2}},
    "gemma4_unified_assistant": {"text_config": {**_GEMMA4, **_NO_PER_LAYER_INPUT}},
    "gemma4_assistant": {"text_config": {**_GEMMA4, **_NO_PER_LAYER_INPUT}},
    "dots3_note": {"text_config": _DOTS3,
                   "vision_config": {"pyramid_num_routed": [-1, 4], "adapter_in_dim": 64, "adapter_out_dim": 64},
                   "audio_config": {"adapter_input_size": 64, "adapter_out_dim": 64, "downsample_hidden_size": 16,
                                    "feature_size": 16}},
    "dots3_note_text": _DOTS3,
    "cohere_compass_text": {"rope_parameters": {t: {"rope_type": "default", "rope_theta": 10_000.0}
                                                for t in ("full_attention", "sliding_attention")}},
    "dbrx": {"attn_config": {"rope_theta": 10_000.0, "clip_qkv": 8.0}},
    "marian": {"decoder_vocab_size": VOCAB},
    "inkling2_text": {"unpadded_vocab_size": VOCAB},
    "inkling2_loop_text": {"unpadded_vocab_size": VOCAB},
    "blt": {"encoder_hash_byte_group_vocab": VOCAB},
    "roc_bert": {"shape_vocab_size": 16, "pronunciation_vocab_size": 16, "shape_embed_dim": 16,
                 "pronunciation_embed_dim": 16},
    "phi4_multimodal": {"num_blocks": 2, "ext_pw_out_channel": 64, "depthwise_separable_out_channel": 64,
                        "nemo_conv_channels": 64},
    "reformer": {"axial_pos_shape": [8, 8], "axial_pos_embds_dim": [32, 32], "attn_layers": ["local", "lsh"],
                 "local_attn_chunk_length": 16, "lsh_attn_chunk_length": 16},
    "musicgen": {"num_codebooks": 1},
    "musicgen_melody": {"num_codebooks": 1},
}  # fmt: skip
"""Family → fields set after :data:`SIZES` where the generic sizes do not fit the family (a sub-config's fields as a
dict under its name, for the families of :data:`CONSTRUCTED`)."""

_DRAFTER = (
    "a drafter for a target model: its forward needs the target's inputs_embeds and shared_kv_states, which a "
    "text-only batch cannot give"
)
NOT_TEXT_ONLY: dict[str, str] = {"gemma4_assistant": _DRAFTER, "gemma4_unified_assistant": _DRAFTER}
"""Families whose causal-LM class cannot run on ``input_ids`` alone, and why (listed, not run)."""

CONSTRUCTED: set[str] = {
    "bamba", "granitemoehybrid", "mamba2", "zamba2", "xlstm", "gemma3n_text", "gemma4", "gemma4_text",
    "gemma4_assistant", "gemma4_unified", "gemma4_unified_text", "gemma4_unified_assistant", "dots3_note",
    "dots3_note_text", "cohere_compass_text", "dbrx", "lfm2_moe",
}  # fmt: skip
"""Families whose config is constructed with :data:`SIZES` and :data:`OVERRIDES` as arguments, not changed after:
their constructor derives fields from the sizes (per-layer configs, shared K/V layers, RoPE per layer type)."""

STRATEGIES = {"ring": {"strategy": "ring"}, "ulysses": {"strategy": "ulysses", "ulysses_degree": 2}}

TOLERANCE = 1e-9
"""A family is equal when the loss and each parameter's gradient are off by at most this, relative to their own
scale (float64 everywhere: what is left is the order of summation across shards)."""

ROUNDING_ZERO = 1e-12
"""A parameter whose largest reference gradient is at most this share of the model's largest is zero up to rounding
(a key bias under softmax: its exact gradient is 0): it is compared absolutely, against the model's largest."""

LOOSER: dict[str, tuple[float, str]] = {}
"""Family → a looser bound its math needs, and why (the table states both)."""


_FACTORIES = (torch.zeros, torch.empty, torch.ones, torch.full)
"""Tensor factories whose ``dtype=torch.float32`` :class:`Float64Throughout` makes float64 (no float64 argument tells
it the tensor is part of a float64 computation; in the zoo, every floating tensor is)."""


class Float64Throughout(TorchFunctionMode):
    """While active, a float64 tensor is never rounded to float32: ``x.to(torch.float32)``, ``x.float()``,
    ``x.type(torch.float32)`` and a ``dtype=torch.float32`` argument (eager attention's softmax, RMSNorm, rotary
    tables, routers, Mamba's scan) keep float64, as does a float32 tensor made by a factory (:data:`_FACTORIES`), and
    ``grid_sample`` of a float64 input samples at a float64 grid
    (GLM-4V builds its grid in float32 from integer image sizes; ``grid_sample`` takes no mixed dtypes), and a float32
    matrix times a float64 one is float64 (SigLIP2's position-resize weights, float32 from integer sizes). Both the
    reference and ds_ring run under it: a difference of 1e-16 in an attention output would otherwise flip a float32
    rounding (6e-8 relative), and eager's float32 softmax alone is off by 1e-8."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func in _FACTORIES and kwargs.get("dtype") == torch.float32:  # ERNIE 4.5-VL's router-logit buffer
            kwargs = {**kwargs, "dtype": torch.float64}
        if any(isinstance(a, torch.Tensor) and a.dtype == torch.float64 for a in args):
            if func is torch.Tensor.float:
                return args[0]
            if kwargs.get("dtype") == torch.float32:
                kwargs = {**kwargs, "dtype": torch.float64}
            if func in (torch.Tensor.to, torch.Tensor.type):
                args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            if func is F.grid_sample and args[1].dtype == torch.float32:  # GLM-4V's grid from integer sizes
                args = (args[0], args[1].double(), *args[2:])
            if getattr(func, "__name__", "") in ("__matmul__", "matmul") and args[0].dtype == torch.float32:  # SigLIP2
                args = (args[0].double(), *args[1:])
        return func(*args, **kwargs)


@dataclass(frozen=True)
class Outcome:
    """One family under one strategy: ``status`` in equal / refused / wrong / crash, and why."""

    family: str
    strategy: str
    status: str
    detail: str = ""


def families() -> list[str]:
    """Every family of transformers' causal-LM mapping, in its order."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _configs(config: Any) -> list[Any]:
    """``config`` and every config nested in it (text, vision, audio, encoder / decoder parts), each once."""
    from transformers import PretrainedConfig

    found: dict[int, Any] = {}
    stack = [config]
    while stack:
        target = stack.pop()
        if id(target) in found:
            continue
        found[id(target)] = target
        stack += [v for v in vars(target).values() if isinstance(v, PretrainedConfig)]
    return list(found.values())


def _text_config(config: Any) -> Any:
    """The config nested in ``config`` of its text decoder, else ``config`` itself (an encoder-decoder config gives
    a new decoder-only copy: its causal-LM class reads ``config``)."""
    text = config.get_text_config(decoder=True)
    return text if any(text is v for v in vars(config).values()) else config


def _arguments(cls: type, overrides: dict[str, Any], defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """Constructor arguments of config class ``cls``: its composite's ``defaults`` for it, the :data:`SIZES` it has
    fields for, each sub-config's arguments as a dict, then ``overrides``."""
    fields = getattr(cls, "__dataclass_fields__", {})
    arguments: dict[str, Any] = {**(defaults or {}), **{k: v for k, v in SIZES.items() if k in fields}}
    for name, spec in (getattr(cls, "sub_configs_defaults", None) or getattr(cls, "sub_configs", {})).items():
        sub = overrides.get(name, {})
        sub_cls = getattr(spec, "config_class", spec)
        if getattr(spec, "model_type", None):  # resolved through AutoConfig
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING

            sub_cls = CONFIG_MAPPING[spec.model_type]
        sub_defaults = {k: v for k, v in getattr(spec, "init_kwargs", {}).items() if k not in SIZES}
        arguments[name] = _arguments(sub_cls, sub if isinstance(sub, dict) else {}, sub_defaults)
        if getattr(spec, "model_type", None):
            arguments[name]["model_type"] = spec.model_type
    return {**arguments, **{k: v for k, v in overrides.items() if not isinstance(arguments.get(k), dict)}}


def tiny_config(family: str) -> Any:
    """The family's default config with :data:`SIZES` (then :data:`OVERRIDES`) applied to it and every config
    nested in it, dropout off, decoder-only (an encoder-decoder family's causal-LM class is its decoder)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    overrides = OVERRIDES.get(family, {})
    if family in CONSTRUCTED:
        config = CONFIG_MAPPING[family](**_arguments(CONFIG_MAPPING[family], overrides))
    else:
        config = CONFIG_MAPPING[family]()
    for target in _configs(config):
        for key, value in ({} if family in CONSTRUCTED else {**SIZES, **overrides}).items():
            if hasattr(target, key) or (key in overrides and target is _text_config(config)):
                # a derived property (Falcon's head_dim) or a field that has no setter (XLNet's positions)
                with contextlib.suppress(AttributeError, NotImplementedError):
                    setattr(target, key, value)
        if getattr(target, "kv_lora_rank", None):  # latent attention: keys and values have every head
            target.num_key_value_heads = target.num_attention_heads
        if hasattr(target, "is_decoder"):  # encoder families' causal-LM heads need it (transformers says so)
            target.is_decoder = True
        if getattr(target, "is_encoder_decoder", False):
            target.is_encoder_decoder = False
        for key, value in list(vars(target).items()):
            if isinstance(value, float) and not isinstance(value, bool) and re.search(r"dropout|pdrop", key):
                setattr(target, key, 0.0)
    return config


def build(family: str, attention: str = "eager") -> torch.nn.Module:
    """The tiny float64 model of ``family`` (seeded: the same weights on every rank), in training mode."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if family in NOT_TEXT_ONLY:
        raise ValueError(NOT_TEXT_ONLY[family])
    config = tiny_config(family)
    causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    if not isinstance(config, causal_lm.config_class):  # its causal LM is a part's (MusicGen's decoder)
        config = next((c for c in _configs(config) if isinstance(c, causal_lm.config_class)), config)
    with torch.device("meta"):
        size = sum(p.numel() for p in causal_lm._from_config(config).parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"not tiny: {size:,} parameters")
    torch.manual_seed(0)
    model = causal_lm._from_config(
        config,
        dtype=torch.float64,  # buffers computed at construction too (MiniMax's decays, rotary tables)
        attn_implementation=attention,
        experts_implementation="eager",  # grouped_mm has no float64
    ).double()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model.train()


def build_failures(names: Iterable[str]) -> dict[str, str]:
    """Family → why it does not build tiny here (an encoder-decoder, not tiny, a missing package, an error)."""
    failures = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for family in names:
            try:
                build(family)
            except Exception as err:  # noqa: BLE001 - every reason is listed, none is fatal
                reason = err.__cause__ or err  # a config validator's reason is its cause
                lines = [line.strip() for line in str(reason).splitlines() if line.strip()]
                failures[family] = f"{type(reason).__name__}: {lines[0][:160]}" if lines else type(reason).__name__
    return failures


def batch() -> dict[str, torch.Tensor]:
    """``input_ids [BATCH, SEQ]`` (ids ≥ 3: no pad / bos / eos) and labels with a few ignored tokens."""
    input_ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    labels = input_ids.clone()
    labels[0, :3] = -100
    return {"input_ids": input_ids, "labels": labels}


def _shifted(labels: torch.Tensor) -> torch.Tensor:
    return F.pad(labels, (0, 1), value=-100)[:, 1:]


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0]


def reference(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The whole model on the whole batch: the token-mean loss and every parameter's gradient (zero where the
    loss does not reach a parameter: ds_ring must leave it zero too)."""
    model.zero_grad()
    logits = _logits(model(input_ids=full["input_ids"]))
    loss = F.cross_entropy(logits.flatten(0, 1).double(), _shifted(full["labels"]).flatten(), ignore_index=-100)
    loss.backward()
    return loss.detach(), {
        n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()
    }


def _implementation(model: torch.nn.Module) -> str:
    """``sdpa`` where the family allows it, else ds_ring's own registry entry; a family that takes no attention
    implementation but eager (Mamba, xLSTM: no attention at all) is left as transformers builds it and registered
    over ``sdpa``, as its users do."""
    if not getattr(model, "_supports_sdpa", False) and getattr(model, "_supports_attention_backend", True) is False:
        return "sdpa"
    with contextlib.suppress(ValueError, ImportError):
        model.set_attn_implementation("sdpa")
    text = model.config.get_text_config()  # the language model's: a vision tower may stay eager (GOT-OCR2's)
    if text._attn_implementation != "sdpa":  # the family allows no sdpa
        model.set_attn_implementation("ds_ring")
    used = text._attn_implementation
    return "sdpa" if used == "eager" else used  # eager only: registration says why it cannot run


def sequence_parallel(
    model: torch.nn.Module, full: dict[str, torch.Tensor], section: dict[str, Any], topology: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The registered model on this rank's shard: the loss and every gradient summed over the group."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ds_ring.integrations.hf import register_with_transformers
    from ds_ring.integrations.hf.registration import OWN_NAME

    if OWN_NAME not in ALL_ATTENTION_FUNCTIONS:  # the entry exists before a model may select it
        ALL_ATTENTION_FUNCTIONS[OWN_NAME] = ALL_ATTENTION_FUNCTIONS["sdpa"]
    implementation = _implementation(model)
    config = {"train_micro_batch_size_per_gpu": BATCH, "ring_attention": {"timeout_s": 60, **section}}
    session = register_with_transformers(
        model, core_attn_implementation=implementation, config=config, topology=topology
    )
    return trained_on_shards(model, session, full, topology)


def trained_on_shards(
    model: torch.nn.Module, session: Any, full: dict[str, torch.Tensor], topology: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One step of the registered ``model`` on :func:`shard_batch`'s shard of ``full`` (the session closed and eager
    attention set back after it): the loss and every gradient summed over the group."""
    from ds_ring.integrations.hf import causal_lm_loss, shard_batch

    try:
        sharded = shard_batch(session, full)
        model.zero_grad()
        logits = _logits(model(**{k: v for k, v in sharded.items() if k != "shift_labels"}))
        loss = causal_lm_loss(session, logits, sharded["shift_labels"])
        loss.backward()
    finally:
        session.close()
        model.set_attn_implementation("eager")
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach() for n, p in model.named_parameters()}
    flat = torch.cat([g.flatten() for g in grads.values()])
    dist.all_reduce(flat, group=topology.sequence_parallel_group)
    summed = dict(zip(grads, flat.split([g.numel() for g in grads.values()]), strict=True))
    return loss.detach(), {n: summed[n].view_as(g) for n, g in grads.items()}


def relative_error(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """max |Δg| / max |g| over every parameter the reference has a gradient for (one model-wide scale)."""
    scale = max(float(g.abs().max()) for g in expected.values())
    worst = max(float((got[n] - g).abs().max()) for n, g in expected.items())
    return worst / max(scale, 1e-300)


@dataclass(frozen=True)
class Error:
    """The worst of a step's errors: ``name`` (a parameter, or ``loss``) and its error ``value``, relative to its own
    scale, or, where ``absolute`` (the reference gradient is exactly zero), to the largest gradient of the model."""

    name: str
    value: float
    absolute: bool = False

    def __str__(self) -> str:
        scale = "of the model's largest gradient (its own is 0 to rounding)" if self.absolute else "relative"
        return f"worst {self.name}: {_order(self.value)} {scale}"


def _order(value: float) -> str:
    """``value`` rounded up to a power of ten (``≤ 1e-13``): what a table can state alike run after run."""
    return "0" if value == 0 else f"≤ 1e{math.ceil(math.log10(value))}"


def worst_error(
    got_loss: torch.Tensor, got: dict[str, torch.Tensor], loss: torch.Tensor, expected: dict[str, torch.Tensor]
) -> Error:
    """The loss's relative error and each parameter's ``max|Δg_p| / max|g_p|`` (``max|Δg_p| / max|g|`` over the
    model where ``g_p`` is zero to rounding, :data:`ROUNDING_ZERO`), the worst of them."""
    scale = max(max(float(g.abs().max()) for g in expected.values()), 1e-300)
    worst = Error("loss", abs(float(got_loss) - float(loss)) / abs(float(loss)))
    for name, g in expected.items():
        own, diff = float(g.abs().max()), float((got[name] - g).abs().max())
        zero = own <= ROUNDING_ZERO * scale
        error = Error(name, diff / scale, absolute=True) if zero else Error(name, diff / own)
        if error.value > worst.value or math.isnan(error.value):
            worst = error
    return worst


def _reference_or_why(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> tuple[Any, Any, str | None]:
    """The reference (in eval mode where training is random, e.g. PhiMoE's sparsemixer), or why there is none."""
    try:
        loss, grads = reference(model, full)
        if not torch.equal(reference(model, full)[0], loss):
            model.eval()
            loss, grads = reference(model, full)
    except Exception as err:  # noqa: BLE001 - no reference: listed, after ds_ring had its say
        return None, None, f"{type(err).__name__}: {str(err)[:100]}"
    return loss, grads, None


def _raised_by_ds_ring(err: BaseException) -> bool:
    """Whether ``err`` was raised in ds_ring's own code (a refusal), not in the model's."""
    frame = err.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    return frame is not None and DS_RING in Path(frame.tb_frame.f_code.co_filename).resolve().parents


def _failed(family: str, strategy: str, err: BaseException, missing: str | None) -> Outcome:
    """A step that raised: *refused* (a ``ValueError`` of ds_ring's), else *no reference* where the whole model
    fails too (the tiny config is at fault), else *crash*."""
    if isinstance(err, ValueError) and _raised_by_ds_ring(err):
        return Outcome(family, strategy, "refused", str(err).splitlines()[0])
    if missing is not None:
        return Outcome(family, strategy, "no reference", missing)
    trace = "".join(traceback.format_exception(err)).strip().splitlines()
    return Outcome(family, strategy, "crash", f"{type(err).__name__}: {err} ({trace[-3].strip()})")


def check(family: str, strategies: list[str], topologies: dict[str, Any]) -> list[Outcome]:
    """One family under each of ``strategies``, on this rank (every rank of the group calls it alike): the model is
    built and its reference computed once."""
    full = batch()
    model = build(family)
    with Float64Throughout():
        expected = _reference_or_why(model, full)
    bound, why_looser = LOOSER.get(family, (TOLERANCE, ""))

    def step(strategy: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return sequence_parallel(model, full, STRATEGIES[strategy], topologies[strategy])

    return outcomes_against(family, strategies, step, expected, bound, why_looser)


def outcomes_against(
    family: str,
    strategies: list[str],
    step: Callable[[str], tuple[torch.Tensor, dict[str, torch.Tensor]]],
    expected: tuple[Any, Any, str | None],
    bound: float = TOLERANCE,
    why_looser: str = "",
) -> list[Outcome]:
    """``step(strategy)`` (the loss and summed gradients, in float64 throughout) for each of ``strategies``, against
    ``expected`` = the whole model's loss, gradients and why there is none (``None``: there is)."""
    loss, grads, missing = expected
    outcomes = []
    for strategy in strategies:
        try:
            with Float64Throughout():
                got_loss, got_grads = step(strategy)
        except Exception as err:  # noqa: BLE001 - refused, or an outcome to report
            outcomes.append(_failed(family, strategy, err, missing))
            continue
        if missing is not None:
            outcomes.append(Outcome(family, strategy, "no reference", missing))
            continue
        error = worst_error(got_loss, got_grads, loss, grads)
        status = "equal" if error.value <= bound else "wrong"
        looser = f"bound {bound:g} ({why_looser}); " if why_looser else ""
        outcomes.append(Outcome(family, strategy, status, looser + str(error)))
    return outcomes


def run_zoo(rank: int, world: int, names: list[str], strategies: list[str]) -> list[Outcome]:
    """Rank function: every family in ``names`` under every strategy (ranks agree on each outcome)."""
    return agreed_outcomes(world, names, strategies, STRATEGIES, check)


def agreed_outcomes(
    world: int,
    names: list[str],
    strategies: list[str],
    sections: dict[str, dict[str, Any]],
    check: Callable[[str, list[str], dict[str, Any]], list[Outcome]],
) -> list[Outcome]:
    """On each rank of a zoo's world: ``check(family, strategies, topologies)`` for every family of ``names``, with a
    topology per strategy from its ``ring_attention`` section (``sections``); an outcome the ranks disagree on is a
    crash."""
    import transformers

    import ds_ring

    transformers.logging.set_verbosity_error()
    warnings.simplefilter("ignore")
    topologies = {
        name: ds_ring.Topology(*ds_ring.load_config({"ring_attention": section}).degrees(world))
        for name, section in sections.items()
    }
    outcomes = []
    for family in names:
        for outcome in check(family, strategies, topologies):
            statuses = [None] * world
            dist.all_gather_object(statuses, outcome.status)
            if len(set(statuses)) > 1:  # one rank refused or crashed alone: the others' outcome is moot
                outcome = Outcome(family, outcome.strategy, "crash", f"ranks disagree: {statuses}: {outcome.detail}")
            outcomes.append(outcome)
    return outcomes


def table(outcomes: list[Outcome], not_built: dict[str, str], seconds: float) -> str:
    """The docs page: totals per strategy, then one row per family (its worst gradient, or why not equal)."""
    about = f"""\
Generated by `python -m tests.zoo`; `pytest -m zoo tests/test_model_zoo.py` runs the same code and fails
when this page differs from its run (the run-time line aside); do not edit by hand. Every family of
transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` built tiny (2 layers, hidden 64, 4 heads / 2 K/V heads,
vocab {VOCAB}, sliding windows of {WINDOW} tokens; per-family sizes in `tests/zoo.py`), random weights,
float64 throughout (the model's own float32 roundings kept in float64); {BATCH} × {SEQ} tokens on 2 ranks.
*equal*: the loss and each parameter's gradient (summed over the ranks) equal the whole model's with
`eager` attention to {TOLERANCE:g} relative to that parameter's own largest gradient (a parameter whose
gradient is zero to rounding, e.g. a key bias, against the model's largest), or the looser bound a row
states; the last column names the worst parameter and its error, rounded up to a power of ten, in the
run that wrote this page (the test compares statuses and reasons: which parameter is worst at rounding
level moves with the kernels' summation order)."""
    title = "transformers' causal-LM zoo under ds_ring"
    return page(title, about, outcomes, "Not built tiny here", not_built, seconds)


def page(
    title: str, about: str, outcomes: list[Outcome], left_out_title: str, left_out: dict[str, str], seconds: float
) -> str:
    """A zoo's docs page: ``# title``, the ``about`` paragraph (its lines kept), how a refusal shows, the run time
    (the line :func:`without_run_time` sets aside), then :func:`result_tables`."""
    lines = [f"# {title}", "", *about.splitlines(), "*refused*: a `ValueError` before the first step says why."]
    lines += [f"Run in {seconds:.0f} s.", ""]
    return "\n".join(lines + result_tables(outcomes, left_out_title, left_out)) + "\n"


def result_tables(outcomes: list[Outcome], left_out_title: str, left_out: dict[str, str]) -> list[str]:
    """The tables of a zoo page, as lines: totals per strategy, one row per family (its worst gradient, or why not
    equal), then the families left out (``## left_out_title``) and why."""
    strategies = list(dict.fromkeys(o.strategy for o in outcomes))
    by = {(o.family, o.strategy): o for o in outcomes}
    lines = ["| | " + " | ".join(strategies) + " |", "|---|" + "---|" * len(strategies)]
    for status in ("equal", "refused", "wrong", "crash", "no reference"):
        counts = [sum(1 for o in outcomes if o.strategy == s and o.status == status) for s in strategies]
        lines.append(f"| {status} | " + " | ".join(map(str, counts)) + " |")
    header = "| family | " + " | ".join(strategies) + " | worst gradient, or why not equal |"
    lines += ["", header, "|---|" + "---|" * (len(strategies) + 1)]
    for name in dict.fromkeys(o.family for o in outcomes):
        row = [by[name, s] for s in strategies]
        details = list(dict.fromkeys(o.detail for o in row))
        why = details[0] if len(details) == 1 else "; ".join(f"{o.strategy}: {o.detail}" for o in row)
        lines.append(f"| {name} | " + " | ".join(o.status for o in row) + f" | {why.replace('|', '/')} |")
    lines += ["", f"## {left_out_title}", "", "| family | why |", "|---|---|"]
    return lines + [f"| {name} | {why.replace('|', '/')} |" for name, why in left_out.items()]


RUN_TIME = re.compile(r"^Run in \d+ s\.$", re.MULTILINE)
"""The one line of :func:`table` that differs from run to run."""


def without_run_time(page: str) -> str:
    """``page`` without its run-time line, and an all-equal row's worst parameter (rounding-level detail that moves
    with the kernels' summation order): what a fresh run must reproduce."""
    page = RUN_TIME.sub("Run in … s.", page)
    return EQUAL_ROW.sub(lambda m: m.group(1) + "equal |", page)


EQUAL_ROW = re.compile(r"^(\| [^|]+ (?:\| equal )+\| )[^\n]*\|$", re.MULTILINE)
"""A family's row whose every strategy is equal, up to its worst-parameter column."""


def run(names: list[str], strategies: list[str]) -> tuple[list[Outcome], dict[str, str]]:
    """Every family of ``names`` that builds tiny, on 2 ranks under ``strategies``; and why the others do not."""
    from ds_ring.testing import rank_results, spawn_ranks

    not_built = build_failures(names)
    built = [n for n in names if n not in not_built]
    outcomes = rank_results(spawn_ranks(run_zoo, 2, timeout_s=3600, kwargs={"names": built, "strategies": strategies}))
    return outcomes[0], not_built


def assert_expected(
    outcomes: list[Outcome],
    expected: Callable[[Outcome], str | None],
    left_out: dict[str, str] | None = None,
    left_out_as: str = "left out",
) -> None:
    """Fail naming every outcome other than equal, or other than the refusal ``expected(outcome)`` gives the reason
    of (a regular expression its detail must match; ``None``: equal expected), and every family ``left_out``."""
    off = []
    for outcome in outcomes:
        reason = expected(outcome)
        where = f"{outcome.family} ({outcome.strategy}): {outcome.status}: {outcome.detail}"
        if reason is None and outcome.status != "equal":
            off.append(f"{where} (expected equal)")
        elif reason is not None and not (outcome.status == "refused" and re.search(reason, outcome.detail)):
            off.append(f"{where} (expected refused: {reason})")
    off += [f"{name}: {left_out_as}: {why}" for name, why in (left_out or {}).items()]
    assert not off, f"{len(off)} families off:\n" + "\n".join(off)


def assert_every_family(
    zoo: Callable[[list[str], list[str]], tuple[list[Outcome], dict[str, str]]],
    names: list[str],
    strategies: list[str],
    expected: Callable[[Outcome], str | None],
    page: Callable[[list[Outcome], dict[str, str], float], str],
    committed: Path,
    module: str,
) -> None:
    """Run ``zoo`` over ``names``: every outcome as :func:`assert_expected` wants, and the ``page`` the run writes
    equal to the ``committed`` one (run-time details aside; else the diff and ``python -m <module>`` to regenerate)."""
    start = time.perf_counter()
    outcomes, left_out = zoo(names, strategies)
    assert_expected(outcomes, expected)
    fresh = without_run_time(page(outcomes, left_out, time.perf_counter() - start)).splitlines(True)
    diff = "".join(difflib.unified_diff(without_run_time(committed.read_text()).splitlines(True), fresh, "committed",
                                        "this run"))  # fmt: skip
    assert not diff, f"{committed} differs from this run; regenerate it with `python -m {module}`:\n{diff}"


def main(
    argv: list[str] | None = None,
    *,
    out: str = "docs/model_zoo.md",
    zoo: Callable[[list[str], list[str]], tuple[list[Outcome], dict[str, str]]] = run,
    every: Callable[[], list[str]] = families,
    strategies: Iterable[str] = STRATEGIES,
    page: Callable[[list[Outcome], dict[str, str], float], str] = table,
    description: str | None = __doc__,
) -> None:
    """Run ``zoo`` over the families asked for (default: ``every()``) and write its ``page`` to ``--out``; the
    causal-LM zoo's by default, :mod:`tests.vlm_zoo`'s with its own arguments."""
    parser = argparse.ArgumentParser(description=(description or "").splitlines()[0])
    parser.add_argument("--out", default=out)
    parser.add_argument("--families", nargs="*", help="only these (default: every family)")
    parser.add_argument("--strategies", nargs="*", default=list(strategies))
    parser.add_argument("--update", action="store_true", help="rewrite only these families' rows of --out")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    outcomes, left_out = zoo(args.families or every(), args.strategies)
    width = max((len(o.family) for o in outcomes), default=0)
    for o in outcomes:
        print(f"{o.family:{width}s} {o.strategy:8s} {o.status:8s} {o.detail}")
    fresh = page(outcomes, left_out, time.perf_counter() - start)
    if args.update:
        fresh = updated_page(Path(args.out).read_text(), fresh, every())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(fresh)
    print(f"wrote {args.out}")


def _parts(page: str) -> tuple[list[str], list[str], dict[str, str], list[str], dict[str, str]]:
    """A zoo page (:func:`page`) cut into its lines before the totals, the family table's header, its rows (family →
    line), the left-out section's header and its rows."""
    lines = page.rstrip("\n").split("\n")
    totals = next(i for i, line in enumerate(lines) if line.startswith("| |"))
    header = next(i for i in range(totals, len(lines)) if lines[i].startswith("| family |"))
    left = next(i for i in range(header, len(lines)) if lines[i].startswith("## "))

    def rows(block: list[str]) -> dict[str, str]:
        return {line.split(" | ")[0][2:]: line for line in block if line.startswith("| ") and not line.startswith("|-")}

    return (
        lines[:totals],
        lines[header : header + 2],
        rows(lines[header + 2 : left]),
        lines[left : left + 4],
        rows(lines[left + 4 :]),
    )


def updated_page(old: str, fresh: str, order: list[str]) -> str:
    """``old`` with the rows of the families ``fresh`` (a page of some families' run) has replaced by its rows, in
    ``order``, and the totals counted again from every row; ``old``'s run-time line kept (it timed the whole run)."""
    before, header, rows, left_header, left = _parts(old)
    _, _, new_rows, _, new_left = _parts(fresh)
    for family in {**new_rows, **new_left}:
        rows.pop(family, None)
        left.pop(family, None)
    rows, left = {**rows, **new_rows}, {**left, **new_left}
    rank = {name: i for i, name in enumerate(order)}
    rows = dict(sorted(rows.items(), key=lambda item: rank.get(item[0], len(rank))))
    left = dict(sorted(left.items(), key=lambda item: rank.get(item[0], len(rank))))
    strategies = header[0].split(" | ")[1:-1]
    statuses = [line.split(" | ")[1 : 1 + len(strategies)] for line in rows.values()]
    totals = ["| | " + " | ".join(strategies) + " |", "|---|" + "---|" * len(strategies)]
    for status in ("equal", "refused", "wrong", "crash", "no reference"):
        counts = [sum(1 for row in statuses if row[i] == status) for i in range(len(strategies))]
        totals.append(f"| {status} | " + " | ".join(map(str, counts)) + " |")
    title = left_header[0].rsplit(" (", 1)[0]  # a count in the title ("Not run here (66)") is counted again
    left_header = [f"{title} ({len(left)})" if left_header[0].endswith(")") else left_header[0], *left_header[1:]]
    lines = [*before, *totals, "", *header, *rows.values(), "", *left_header, *left.values()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
