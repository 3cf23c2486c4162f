"""Registration with transformers: ds_ring's attention in the registry entry a model calls.

DeepSpeed's ALST overwrites transformers' attention registry entry with its Ulysses wrapper; this
module plugs into the same place with every ds_ring strategy, and puts back exactly what it replaced (when the
:class:`~ds_ring.integrations.hf.session.SequenceParallelSession` it returns is closed). It also refuses, from the
model's config and before any communication, what the attention cannot compute.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ds_ring.integrations.hf.attention import SequenceParallelAttention
from ds_ring.integrations.hf.audit import (
    CallAudit,
    ModelWatch,
    computes_attention,
    refuse_probed,
    refuse_sequence_mixers,
)
from ds_ring.integrations.hf.documents import refuse_padding
from ds_ring.integrations.hf.long_context import check_long_context
from ds_ring.integrations.hf.masks import MaskSpec, mask_spec
from ds_ring.integrations.hf.positions import POSITION_TOKENS, refuse_position_blind
from ds_ring.integrations.hf.probe import Probe
from ds_ring.integrations.hf.recurrent import install_recurrent, sequence_parallel_mixers
from ds_ring.integrations.hf.session import SequenceParallelSession, installed_sessions
from ds_ring.integrations.hf.vision import (
    _is_composite,
    cut_point,
    find_language_model,
    refuse_decoder_inputs,
    refuse_encoder_decoder,
    vision_language,
    whole_image_mask,
)
from ds_ring.integrations.internal import (
    SECTION,
    DsConfig,
    Patch,
    RingAttentionConfig,
    Topology,
    read_section,
    set_item,
)

__all__ = [
    "register_with_transformers",
    "unregister_from_transformers",
    "check_model_config",
    "HUB_KERNEL",
    "OWN_NAME",
]

_log = logging.getLogger(__name__)

OWN_NAME = "ds_ring"
"""The registry entry ds_ring adds (``core_attn_implementation="ds_ring"``) for models that allow no ``sdpa`` but
any registered attention (GPT-OSS): build them with ``attn_implementation="ds_ring"``."""

HUB_KERNEL = re.compile(r"^[^/:]+/[^/:]+(?:@[^/:]+)?(?::[^/:]+)?$")
"""A hub kernel's attention implementation name, ``"org/repo[@revision][:function]"`` (e.g.
``"kernels-community/flash-attn2"``): transformers registers it on first use."""


def register_with_transformers(
    model_name_or_path: Any = None,
    *,
    core_attn_implementation: str = "sdpa",
    config: str | os.PathLike | Mapping[str, Any] | DsConfig | None = None,
    topology: Topology | None = None,
    disable_in_eval: bool = False,
    position_wise: Sequence[str] = (),
    divide_vision: bool = True,
) -> SequenceParallelSession:
    """Make transformers' ``core_attn_implementation`` attention run ds_ring sequence-parallel attention.

    Like ALST's ``UlyssesSPAttentionHF.register_with_transformers``: the registry entry every model
    with ``config._attn_implementation == core_attn_implementation`` calls is replaced (models built
    before or after), so the model's own code paths for that implementation stay as they are. The
    replacement converts HF's ``[b, heads, s, d]`` to ds_ring's ``[b, s, heads, d]`` and back, passes
    GQA K/V heads without repeating them, uses the model's ``scaling`` and returns ``(out, None)``.
    Unless ``disable_in_eval``, the mask transformers would build for that implementation is not
    built either (the attention needs none). transformers' ``LOSS_MAPPING["ForCausalLM"]`` is replaced too
    (:func:`~ds_ring.integrations.hf.loss.shard_loss`: ALST's tutorial loss, whose gradient is ``sp ×`` the
    whole model's at ZeRO 0–2 under ALST, trains right). A session still installed is closed first (one is
    installed at a time).

    It does three things, in order: validate (the section, the implementation, the model's config and modules;
    no communication), build the topology (starting ``torch.distributed`` if needed; the ranks agree on the
    section), and replace the registry entries. It does not patch the model: the section's ``long_context`` is
    applied by :meth:`SequenceParallelSession.apply_long_context`.

    Args:
        model_name_or_path: optional: a model, a config, or a model name / local directory whose
            config is read (nothing else) to check heads and features now, before any communication. A model
            instance is also checked for the section's ``long_context`` and watched for the keyword arguments of
            its calls (:class:`~ds_ring.integrations.hf.audit.ModelWatch`).
        core_attn_implementation: the registry entry to replace: ``"sdpa"``, ``"flash_attention_2"``,
            ``"flex_attention"``, a hub kernel (``"kernels-community/flash-attn2"``: transformers registers it
            first), ...; or ``"ds_ring"``, an entry of its own, for models that allow no ``sdpa`` but a registered
            attention (GPT-OSS): build them with ``attn_implementation="ds_ring"``.
        config: the whole ds_config (JSON/YAML path or dict, or the :class:`~ds_ring.config.DsConfig`
            :func:`~ds_ring.config.read_section` read) the engine is built with; its ``ring_attention`` section
            chooses strategy, communication, layout, segment_lengths, dilation_rates and degrees, and its
            ``zero_optimization`` how the engine reduces gradients (:mod:`ds_ring.engine.gradient_scale`). ``None``:
            dense ring attention over every rank, DeepSpeed's ZeRO defaults. A ds_config without the section (or with
            ``enabled: false``) registers nothing and gives a data-parallel-only topology.
        topology: the process groups to use (e.g. ``engine.mpu`` after ``ds_ring.initialize``); its
            degrees must be the section's. ``None``: built from the section, starting
            ``torch.distributed`` from the launcher's environment if it is not started.
        disable_in_eval: ``model.eval()`` runs the original attention on whole sequences.
        position_wise: class names of modules that ds_ring would refuse as sequence mixers
            (:func:`~ds_ring.integrations.hf.audit.refuse_sequence_mixers`) but that the user knows mix nothing
            along the sequence.
        divide_vision: a vision-language model's Qwen-style vision encoder (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) encodes
            only this rank's share of the frames, the rows exchanged (:mod:`~ds_ring.integrations.hf.vision_split`);
            ``False``: every rank encodes every frame. Either is exact.

    A vision-language model instance (:mod:`~ds_ring.integrations.hf.vision`) runs its merge of image features on
    the whole sequence on every rank; the sequence is cut before its language model.

    Nothing runs silently wrong: the model's modules that mix along the sequence other than through attention
    are refused now, found by what they do on a model instance (a dependency probe, whatever they are called:
    :mod:`~ds_ring.integrations.hf.probe`) and by their class names otherwise; while registered, an
    attention module whose first forward does not call ds_ring's attention is refused right after it
    (:class:`~ds_ring.integrations.hf.audit.CallAudit`), a mask ds_ring does not compute is refused on its
    first call (:mod:`~ds_ring.integrations.hf.masks`), and so is an attention call before the section's
    ``long_context`` was applied.

    Returns:
        The :class:`~ds_ring.integrations.hf.session.SequenceParallelSession`: ``session.topology`` is the ``mpu``
        for ``deepspeed.initialize``; :func:`shard_batch`, :class:`SequenceParallelDataLoader` and
        :func:`causal_lm_loss` take the session. ``with register_with_transformers(...) as session:`` closes it at
        the end (or call ``session.close()``).

    Raises:
        ValueError: naming the field and the fix: before any communication, ``eager`` or an unknown
            implementation, a model with attention modules whose config selects another implementation (a model
            with no attention registers as transformers builds it, ``eager``), a model config with heads the
            strategy cannot split, a malformed section, a
            ``long_context`` the model cannot take; on every rank, ranks with different sections; a topology with
            other degrees.
    """
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    loaded = config if isinstance(config, DsConfig) else read_section(config)
    section = loaded.section
    own = core_attn_implementation == OWN_NAME
    if own and disable_in_eval:
        raise ValueError(
            f"disable_in_eval needs an attention to run whole sequences with in eval, and {OWN_NAME!r} replaces none; "
            f"register over the model's own implementation (e.g. 'sdpa'), or leave disable_in_eval off"
        )
    if not own:
        _check_implementation(core_attn_implementation, ALL_ATTENTION_FUNCTIONS)
    model_config, unrouted = _model_config(model_name_or_path, core_attn_implementation)
    if section.enabled:
        refuse_encoder_decoder(model_config)
        cut_point(model_name_or_path)  # a multimodal instance ds_ring cannot cut: refused before it is probed
        refuse_decoder_inputs(model_name_or_path)
    _refuse_vision_by_config(model_name_or_path, model_config, section.enabled)
    if model_config is not None and section.enabled:
        _audit_modules(model_name_or_path, model_config, core_attn_implementation, position_wise, unrouted)
    elif unrouted is not None:
        raise unrouted
    if isinstance(model_name_or_path, torch.nn.Module):
        check_long_context(model_name_or_path, section.long_context)
    if topology is None and not dist.is_initialized():
        from ds_ring.integrations.internal import init_distributed

        init_distributed(section.timeout_s)
    world_size = topology.world_size if topology is not None else dist.get_world_size()
    if model_config is not None and section.enabled:
        check_model_config(model_config, section, world_size)
    loaded.agree(op="register_with_transformers")
    degrees = section.degrees(world_size)
    if topology is None:
        topology = Topology.from_config(section, world_size)
    elif degrees != (topology.data_parallel, topology.ulysses, topology.ring):
        raise ValueError(
            f"topology has data_parallel {topology.data_parallel} × ulysses {topology.ulysses} × ring "
            f"{topology.ring} but {SECTION} gives {' × '.join(map(str, degrees))}; pass the topology built from "
            f"this ds_config (engine.mpu of ds_ring.initialize), or topology=None"
        )
    unregister_from_transformers()
    if not section.enabled:  # every attention on the whole sequence its rank holds: nothing to replace
        return SequenceParallelSession(section, topology, loaded.zero_optimization, None)
    original = None if own else ALL_ATTENTION_FUNCTIONS[core_attn_implementation]
    attention = SequenceParallelAttention(
        section, topology, original, disable_in_eval=disable_in_eval, zero_optimization=loaded.zero_optimization
    )
    vision = vision_language(
        model_name_or_path, topology, section.layout, divide=divide_vision, disable_in_eval=disable_in_eval
    )
    session = SequenceParallelSession(section, topology, loaded.zero_optimization, attention, vision=vision)
    attention.session = session
    attention.vision = vision
    # the instance's own entries, as ALST does (GeneralInterface: they override the class-wide ones)
    replaced = [set_item(ALL_ATTENTION_FUNCTIONS._local_mapping, core_attn_implementation, attention, library=LIB)]
    attention.audit = CallAudit(vision.whole_modules if vision is not None else ())
    if isinstance(model_name_or_path, torch.nn.Module):
        attention.watch = ModelWatch(model_name_or_path)
    if topology.get_sequence_parallel_world_size() > 1:  # ALST's tutorial loss, right at every ZeRO stage
        from transformers.loss.loss_utils import LOSS_MAPPING

        from ds_ring.integrations.hf.loss import shard_loss  # it imports the session

        replaced.append(set_item(LOSS_MAPPING, "ForCausalLM", shard_loss(LOSS_MAPPING["ForCausalLM"], session),
                                 library=LIB))  # fmt: skip
    # with disable_in_eval a text model keeps transformers' mask tensors (the attention checks them in training); a
    # vision-language model's (image spans, a prefix: more than a tensor check allows) come from ds_ring in training
    if (not disable_in_eval or vision is not None) and (
        own or core_attn_implementation in ALL_MASK_ATTENTION_FUNCTIONS
    ):
        masks = whole_image_mask(vision, ALL_MASK_ATTENTION_FUNCTIONS.get(core_attn_implementation), _no_mask)
        own_masks = ALL_MASK_ATTENTION_FUNCTIONS._local_mapping
        replaced.append(set_item(own_masks, core_attn_implementation, masks, library=LIB))
    if own:  # transformers builds masks only for implementations of its class-wide table: the window lives there
        table = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
        replaced.append(set_item(table, OWN_NAME, _no_mask, library=LIB))
    session.on_close(functools.partial(_put_back, tuple(replaced), attention))
    if vision is not None:
        session.on_close(vision.remove)
    # state-space / short-convolution layers of the model instance: their state carried across shards
    session.on_close(install_recurrent(model_name_or_path, topology, section.layout, disable_in_eval=disable_in_eval))
    return session


def unregister_from_transformers(session: SequenceParallelSession | None = None) -> None:
    """Close ``session`` (:meth:`~ds_ring.integrations.hf.session.SequenceParallelSession.close`: the registry entries
    it replaced put back, its ``long_context`` undone); ``None``: every session transformers' attention registry
    holds (no-op if none)."""
    for installed in [session] if session is not None else installed_sessions():
        installed.close()


def _put_back(replaced: tuple[Patch, ...], attention: SequenceParallelAttention) -> None:
    """Put back the registry entries of ``replaced`` (undone in reverse order) and remove the attention's hooks on
    the model."""
    for patch in reversed(replaced):
        patch.undo()
    for hooks in (attention.audit, attention.watch):
        if hooks is not None:
            hooks.remove()
    attention.audit = attention.watch = None


LIB = "transformers"


def _check_implementation(name: str, registry: Mapping[str, Any]) -> None:
    """``ValueError`` unless ``name`` is an implementation ds_ring can replace; a hub kernel name is registered
    by transformers first (as ALST does), so its entry exists to be replaced."""
    if name == "eager" or name.endswith("|eager"):
        raise ValueError(
            f"core_attn_implementation {name!r} materialises [seq, seq] attention weights and cannot run sequence "
            f"parallel; use 'sdpa' (build the model with attn_implementation='sdpa'), a flash attention, "
            f"'flex_attention' or a hub kernel such as 'kernels-community/flash-attn2'"
        )
    if HUB_KERNEL.match(name) and name not in registry:
        from transformers.modeling_flash_attention_utils import lazy_import_flash_attention

        lazy_import_flash_attention(name)
    if name not in registry:
        raise ValueError(f"core_attn_implementation {name!r} is not one of transformers' {sorted(registry)}")


def _model_config(model_name_or_path: Any, implementation: str) -> tuple[Any, ValueError | None]:
    """The model's config: from a model, a config, or a name / directory (``AutoConfig``); ``None`` if none. With it,
    the refusal due if the model has attention modules: its config selects an attention other than the one ds_ring
    replaces (eager only, or another entry). A model with none (Mamba: eager, no attention) needs no entry."""
    if model_name_or_path is None:
        return None, None
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model_name_or_path, PretrainedConfig):
        return model_name_or_path, None
    if hasattr(model_name_or_path, "config"):  # a built model, or a wrapper of one (PEFT): check what it calls
        config = model_name_or_path.config
        used = getattr(_text_config(config), "_attn_implementation", None)  # the language model's, which is sharded
        if used == "eager" and getattr(model_name_or_path, "_supports_attention_backend", True) is False:
            return config, ValueError(
                f"{type(model_name_or_path).__name__} computes attention in its own code (transformers offers it no "
                f"attention implementation but eager, which never calls a registered one): on one rank's shard it "
                f"would attend only within that shard. ds_ring cannot run this model sequence-parallel; train it "
                f"without sequence parallelism"
            )
        if used is not None and used != implementation:  # None: a wrapper's config that does not say
            return config, ValueError(
                f"core_attn_implementation {implementation!r} does not match the {_which(config)}_attn_implementation "
                f"{used!r}; build the model with attn_implementation={implementation!r} (a model whose vision tower "
                f"allows no {implementation!r}: attn_implementation={{'text_config': {implementation!r}}}) "
                + ("" if used == "eager" else f"or register {used!r} ")
                + "so that its language model's attention calls the replaced entry"
            )
        return config, None
    return AutoConfig.from_pretrained(model_name_or_path), None


def _audit_modules(
    model_name_or_path: Any, config: Any, implementation: str, position_wise: Sequence[str], unrouted: Exception | None
) -> None:
    """Refuse the model's modules that would mix along the sequence behind ds_ring's back (:mod:`.audit`).

    A model instance is probed (:func:`~ds_ring.integrations.hf.probe.probe_sequence_mixers`): ``unrouted`` (its
    config selects another attention) is raised if anything mixes the sequence other than the layers ds_ring runs
    sequence-parallel, and nothing else is: a model with no attention (Mamba built as transformers builds it,
    ``_attn_implementation == "eager"``) registers. A model the probe cannot run (meta device, ZeRO 3 partitions),
    a name or a config are judged by their class names, and ``unrouted`` is raised as it stands.
    """
    from ds_ring.integrations.hf.probe import probe_sequence_mixers

    handled = sequence_parallel_mixers(model_name_or_path)
    probe: Probe | str = "registration was given a config or a name"
    inside = {id(m) for mixer in handled for m in mixer.modules()}
    if isinstance(model_name_or_path, torch.nn.Module):
        unregister_from_transformers()  # an installed session's hooks and layers must not see the probe's forward
        declared = set(position_wise)
        probe = probe_sequence_mixers(
            model_name_or_path,
            [implementation],
            lambda m: id(m) in inside or type(m).__name__ in declared,
        )
    if unrouted is not None and not isinstance(probe, Probe):
        raise unrouted
    if unrouted is not None and any(  # an attention module the probe could not read may well attend by itself
        computes_attention(type(m).__name__) and id(m) not in probe.probed and id(m) not in inside
        for m in model_name_or_path.modules()
    ):
        raise unrouted
    if unrouted is not None and probe.mixers:
        eager = getattr(config, "_attn_implementation", None) == "eager"
        if not eager or any(computes_attention(m.owner or type(m.module).__name__) for m in probe.mixers):
            raise unrouted  # attention that runs another entry (or eager only): the config says why
    probed = [m for m in model_name_or_path.modules() if id(m) in probe.probed] if isinstance(probe, Probe) else []
    refuse_sequence_mixers(_module_tree(model_name_or_path, config), position_wise, handled, probed)
    if isinstance(probe, Probe):
        refuse_probed(probe)
        text = _text_config(config)
        vocab = int(getattr(text, "vocab_size", 0) or 0)
        blind = refuse_position_blind(model_name_or_path, min(probe.tokens, POSITION_TOKENS), vocab)
        if blind is not None:
            _log.warning("ds_ring could not check that %s reads position_ids (%s)",
                         type(model_name_or_path).__name__, blind)  # fmt: skip
    elif isinstance(model_name_or_path, torch.nn.Module):
        _log.warning("ds_ring could not probe %s (%s): its modules were judged by class name only",
                     type(model_name_or_path).__name__, probe)  # fmt: skip


def _no_mask(
    *, attention_mask: torch.Tensor | None = None, mask_function: Any = None, **kwargs: Any
) -> MaskSpec | torch.Tensor:
    """The mask function of the replaced implementation: no ``[s, s]`` tensor is built; the attention gets what the
    mask says (:func:`~ds_ring.integrations.hf.masks.mask_spec`: causal, the window, or what it cannot compute).

    Under ``torch.compile`` the mask function cannot be read (the compiler cannot read the closures of functions
    made while it traces): the shard's boolean mask ``[b, 1, s/p, s/p]`` is built as ``sdpa`` builds it, and the
    attention checks it as any mask tensor a model built itself, on the first call of each shape (refused if it says
    more than causal, the window and the documents).

    A :class:`~ds_ring.integrations.hf.masks.MaskSpec` given as ``attention_mask`` is a mask built before, handed on
    (PaliGemma's prefix-LM mask, given to its Gemma, which builds its mask again): returned as is, as transformers
    returns a 4-D mask tensor."""
    if isinstance(attention_mask, MaskSpec):
        return attention_mask
    if torch.compiler.is_compiling():  # padding included: the attention's check refuses it
        from transformers.masking_utils import sdpa_mask

        kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
        return sdpa_mask(attention_mask=attention_mask, mask_function=mask_function, **kwargs)
    refuse_padding(attention_mask)
    known = {"batch_size", "q_length", "kv_length"} <= kwargs.keys()  # transformers 5.0 passes no q_length
    shape = (kwargs["batch_size"], 1, kwargs["q_length"], kwargs["kv_length"]) if known else None
    return dataclasses.replace(mask_spec(mask_function), shape=shape)


def _refuse_vision_by_config(model_name_or_path: Any, config: Any, enabled: bool) -> None:
    """``ValueError`` for a vision-language model given by config or name: ds_ring cuts its sequence at the call of the
    instance's language model (:mod:`~ds_ring.integrations.hf.vision`), which needs the instance."""
    if not enabled or config is None or isinstance(model_name_or_path, torch.nn.Module):
        return
    if getattr(config, "vision_config", None) is not None or _is_composite(config):  # Fuyu: text_config nested
        raise ValueError(
            f"{type(config).__name__} is a vision-language model's config: ds_ring cuts its sequence after the image "
            f"features are merged, at its language model's call, which needs the model instance; pass the model to "
            f"register_with_transformers(model, ...)"
        )


def _module_tree(model_name_or_path: Any, config: Any) -> torch.nn.Module:
    """The model's modules: the instance itself, or the model its config builds on the meta device (no memory)."""
    if isinstance(model_name_or_path, torch.nn.Module):
        found = find_language_model(model_name_or_path)  # a vision-language model: its vision side sees whole images
        return model_name_or_path if found is None else found[1]
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        try:
            return AutoModelForCausalLM.from_config(config)
        except ValueError:  # not a causal LM config (a base model's): build what the config's class builds
            from transformers import AutoModel

            return AutoModel.from_config(config)


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _which(config: Any) -> str:
    """How a message names the language model's config: ``config.`` or ``config.text_config.``."""
    return "model's config." if _text_config(config) is config else "model's config.text_config."


def check_model_config(config: Any, section: RingAttentionConfig, world_size: int) -> None:
    """Refuse a model whose attention ds_ring cannot compute exactly, from its (text) config alone.

    Sliding-window layers, attention sinks and logit soft-capping are computed (each layer's ``sliding_window``,
    ``s_aux`` and ``softcap``).

    Raises:
        ValueError: heads that the section's strategy cannot split over ``world_size`` ranks — naming the config
            field and the fix.
    """
    config = _text_config(config)
    for where, layer in _layer_configs(config):
        heads = getattr(layer, "num_attention_heads", None)
        if heads is None:  # no attention heads to split (the model's sequence mixers were checked on their own)
            continue
        kv_heads = getattr(layer, "num_key_value_heads", None) or heads
        try:
            section.check(world_size=world_size, num_heads=heads, num_kv_heads=kv_heads)
        except ValueError as err:
            raise ValueError(f"{type(config).__name__}{where}.num_attention_heads = {heads}: {err}") from None


def _layer_configs(config: Any) -> list[tuple[str, Any]]:
    """Each decoder layer's config of a heterogeneous config (transformers' ``per_layer_config``: Gemma 4's global
    layers with their own K/V heads, which the config itself refuses to give), with where it is; else the config."""
    if getattr(config, "is_heterogeneous", False):
        return [(f".per_layer_config[{i}]", config.per_layer_config[i]) for i in range(config.num_hidden_layers)]
    return [("", config)]
