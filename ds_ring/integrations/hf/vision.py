"""Vision-language models: the sequence cut after the image features are merged into the text embeddings.

A vision-language model (Qwen2-VL, LLaVA, Idefics3, ...) embeds the whole token sequence, runs its vision tower on
the images, scatters the image features into the embeddings at the image-token positions of the *whole* sequence,
computes its position ids from the whole sequence (Qwen's 3-D MRoPE ``get_rope_index``), and only then calls its
language model. ds_ring cuts the sequence there: every rank runs the model on the whole ``input_ids`` and images (so
the merge and the position ids are the whole sequence's), and a forward pre-hook on the language model
(:class:`VisionLanguage`) hands it this rank's rows of everything that has the sequence dimension:
``inputs_embeds``, ``position_ids`` (the whole sequence's ids for the shard's rows, MRoPE's text row added where
transformers takes one), the deepstack features of Qwen3-VL at ``visual_pos_masks``, token type ids. The language
model then runs sequence-parallel as a text model does, and its logits are this rank's rows.

The gradient contract holds for the parts that run whole on every rank: only this rank's rows of the merged
embeddings reach the loss, so the vision tower's and the embedding's gradients on each rank are its tokens' share,
and their sum over the group is the whole model's.

The vision tower's own attention runs over images, not over the sharded sequence: its attention modules (every
attention module outside the language model) are answered by the attention ds_ring replaced, and the masks built
for its configs by the mask function it replaced (:meth:`VisionLanguage.whole_image`).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ds_ring.integrations.hf.vision_split import FrameSplit, frame_encoders
from ds_ring.integrations.internal import shard_sequence

__all__ = [
    "VisionLanguage",
    "find_language_model",
    "model_inputs",
    "refuse_cross_attention",
    "refuse_decoder_inputs",
    "refuse_encoder_decoder",
    "vision_language",
    "whole_image_mask",
]


def _is_composite(config: Any) -> bool:
    """Whether ``config`` has a vision (or audio) tower's config nested in it."""
    from transformers import PretrainedConfig

    return any(isinstance(getattr(config, name, None), PretrainedConfig) for name in ("vision_config", "audio_config"))


def refuse_encoder_decoder(config: Any) -> None:
    """``ValueError`` for an encoder-decoder model with a vision (or audio) encoder: Florence-2, Pix2Struct, T5Gemma 2,
    a ``VisionEncoderDecoderModel``, ...

    Its config says ``is_encoder_decoder`` and nests the encoder's config (``vision_config``, ``audio_config`` or an
    ``encoder`` config). ds_ring shards one decoder-only sequence, cut after the image features are merged into it;
    such a model has no such sequence: its decoder cross-attends to the encoder's whole output (keys that are not a
    shard of the decoder's sequence) and its text encoder attends bidirectionally, so neither runs sequence-parallel
    as a causal language model does.
    """
    from transformers import PretrainedConfig

    if config is None or not getattr(config, "is_encoder_decoder", False):
        return
    towers = [
        n
        for n in ("vision_config", "audio_config", "encoder")
        if isinstance(getattr(config, n, None), PretrainedConfig)
    ]
    if towers:
        raise ValueError(
            f"{type(config).__name__} is an encoder-decoder model (is_encoder_decoder, its encoder's config in "
            f"{towers[0]}): its decoder cross-attends to the encoder's whole output, which is not a shard of the "
            f"decoder's sequence, and ds_ring shards only a decoder-only sequence with the images merged into it; "
            f"train this model without sequence parallelism"
        )


def refuse_decoder_inputs(model: Any) -> None:
    """``ValueError`` for a vision-language model instance whose ``forward`` takes ``decoder_input_ids`` and whose
    decoder (``get_decoder()``) is not its language model (neither holds the other): it decodes a second sequence
    (DiffusionGemma's block-diffusion canvas) against the encoded ``input_ids`` (their hidden states or their KV cache),
    whose keys would be only a shard of them under ds_ring's cut, and its logits are that second sequence's, not the
    next tokens of ``input_ids`` that :func:`causal_lm_loss` takes; its config need not say ``is_encoder_decoder``.
    BLIP-2 names ``decoder_input_ids`` for a T5 language model, and with OPT its decoder is its language model: not
    refused here."""
    if not isinstance(model, nn.Module) or not _is_composite(getattr(model, "config", None)):
        return
    if "decoder_input_ids" not in model_inputs(model) or not hasattr(model, "get_decoder"):
        return
    found = find_language_model(model)
    decoder = model.get_decoder()
    if found is None or not isinstance(decoder, nn.Module):
        return
    language_model = found[1]
    if any(m is language_model for m in decoder.modules()) or any(m is decoder for m in language_model.modules()):
        return
    raise ValueError(
        f"{type(model).__name__}'s forward takes decoder_input_ids and its decoder ({type(decoder).__name__}) is not "
        f"its language model: it decodes a second sequence against the whole encoded input_ids (their hidden states "
        f"or KV cache), and its logits are that sequence's, not the next tokens of input_ids; ds_ring shards one "
        f"decoder-only sequence with the images merged into it, so the decoder would read only this rank's shard of "
        f"the encoded input; train this model without sequence parallelism"
    )


_CROSS_ATTENTION = re.compile(r"cross_?att|encoder_?attn", re.IGNORECASE)
"""Names of cross-attention modules (Mllama's ``cross_attn``, BART-style ``encoder_attn``) and their classes."""


def refuse_cross_attention(model_class: str, path: str, language_model: nn.Module) -> None:
    """``ValueError`` for a language model with cross-attention layers (Mllama): their keys are the image features,
    which are not a shard of the sequence, so ds_ring's attention would exchange them over the ranks as if they were;
    found by the module's name or class (``cross_attn``, ``encoder_attn``, ``...CrossAttention``)."""
    for name, module in language_model.named_modules():
        if _CROSS_ATTENTION.search(name.rsplit(".", 1)[-1]) or _CROSS_ATTENTION.search(type(module).__name__):
            raise ValueError(
                f"{model_class}'s language model ({path}) cross-attends to the image features "
                f"({type(module).__name__} at {path}.{name}): its keys are not a shard of the sequence, and ds_ring "
                f"shards only a sequence with the images merged into it; train this model without sequence "
                f"parallelism"
            )


def find_language_model(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The language model of a vision-language model instance (its path and module): the sub-model whose config is
    the model's text config and that holds the decoder layers; ``None`` for a model without a vision tower's config or
    without such a sub-model."""
    config = getattr(model, "config", None)
    if config is None or not _is_composite(config) or not hasattr(config, "get_text_config"):
        return None
    text = config.get_text_config()
    found = [
        (path, module)
        for path, module in model.named_modules()
        if module is not model and path and getattr(module, "config", None) is text and hasattr(module, "layers")
    ]
    if found:
        return min(found, key=lambda item: item[0].count("."))
    return None


class VisionLanguage:
    """A registered vision-language model instance: the cut before its language model, and what runs over images.

    Args:
        model: the model instance.
        path: where its language model is (:func:`find_language_model`).
        language_model: that module.
        topology: the process groups (this rank's shard: the section's ``layout`` over the sequence-parallel group).
        layout: the section's layout (``"contiguous"`` or ``"zigzag"``).
        divide: divide a Qwen-style vision encoder's frames over the ranks
            (:class:`~ds_ring.integrations.hf.vision_split.FrameSplit`) rather than encode every frame on every rank.
        disable_in_eval: in eval mode the language model runs the whole sequence (no cut), as the registration's
            ``disable_in_eval`` runs the original attention on it.
    """

    def __init__(
        self,
        model: nn.Module,
        path: str,
        language_model: nn.Module,
        topology: Any,
        layout: str,
        *,
        divide: bool,
        disable_in_eval: bool = False,
    ) -> None:
        self.model_class = type(model).__name__
        self.inputs = model_inputs(model)
        """What the model's ``forward`` names: the keys a batch may carry (the images, grids, token types)."""
        self.path = path
        self.language_model = language_model
        self.topology = topology
        self.layout = layout
        self.disable_in_eval = disable_in_eval
        inside = {id(m) for m in language_model.modules()}
        self.whole_modules = frozenset(id(m) for m in model.modules() if id(m) not in inside)
        """Modules outside the language model: they run on whole images (or the whole sequence before the cut)."""
        text = getattr(language_model, "config", None)
        self.whole_configs = frozenset(
            id(c) for m in model.modules() if id(m) not in inside and (c := getattr(m, "config", None)) is not None
        ) - {id(text), id(getattr(model, "config", None))}
        """Configs of the vision side: masks built for them are built by the mask function ds_ring replaced."""
        self.mrope = _mrope(text) or any(hasattr(m, "mrope_section") for m in language_model.modules())
        self._handle = language_model.register_forward_pre_hook(self._cut, with_kwargs=True)
        outside = [m for m in model.modules() if id(m) not in inside]
        encoders = frame_encoders(outside) if divide else []
        self.splits = [FrameSplit(encoder, topology, disable_in_eval=disable_in_eval) for encoder in encoders]
        """The vision encoders whose frames are divided over the ranks."""

    def remove(self) -> None:
        """Take the hooks off the language model and the vision encoders."""
        self._handle.remove()
        for split in self.splits:
            split.remove()

    def whole_image(self, module: nn.Module) -> bool:
        """Whether ``module`` (an attention module calling the registry) runs over images, not the sharded sequence."""
        return id(module) in self.whole_modules

    def whole_mask(self, config: Any) -> bool:
        """Whether a mask built for ``config`` is the vision side's (an image's), not the sharded sequence's."""
        return config is not None and id(config) in self.whole_configs

    def _cut(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        """The language model's call with this rank's rows of every input that has the sequence dimension."""
        if self.disable_in_eval and not module.training:
            return args, kwargs
        if args:
            raise ValueError(
                f"{self.model_class} calls its language model ({self.path}) with positional arguments, so ds_ring "
                f"cannot tell which are sequences to cut into this rank's rows; train this model without sequence "
                f"parallelism"
            )
        embeds = kwargs.get("inputs_embeds")
        tokens = embeds if embeds is not None else kwargs.get("input_ids")
        if tokens is None:
            return args, kwargs
        rows, seq_len = tokens.shape[0], tokens.shape[1]
        group = self.topology.sequence_parallel_group
        cut = dict(kwargs)
        cut["position_ids"] = self._positions(kwargs.get("position_ids"), rows, seq_len, tokens.device)
        masks = kwargs.get("visual_pos_masks")
        if masks is not None:  # Qwen3-VL's deepstack: features of the visual positions, in sequence order
            cut["visual_pos_masks"] = shard_sequence(masks, group, layout=self.layout, dim=1)
            cut["deepstack_visual_embeds"] = self._visual_rows(masks, kwargs.get("deepstack_visual_embeds"))
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            if not bool(mask.all()):
                raise ValueError(
                    f"{self.model_class}'s batch has an attention mask with zeros (padding); ds_ring's attention "
                    f"computes no padding mask: pack the sequences or give padding label -100 and a mask of ones"
                )
            cut["attention_mask"] = None
        for key, value in kwargs.items():
            if key in cut and cut[key] is not value:
                continue
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (rows, seq_len):
                cut[key] = shard_sequence(value, group, layout=self.layout, dim=1)
        return (), cut

    def _positions(self, positions: torch.Tensor | None, rows: int, seq_len: int, device: torch.device) -> torch.Tensor:
        """This rank's rows of the whole sequence's position ids.

        ``None`` (the model computed none: every family without MRoPE) is ``arange(S)``, which the language model
        would otherwise make of the shard's own length. MRoPE ids (``[3, b, S]`` from ``get_rope_index``) get the text
        row transformers reads as the attention's ``position_ids`` (``[4, b, S]``, row 0 ``arange(S)``: one
        document per row); without it their language model would pass the attention none.
        """
        text = torch.arange(seq_len, device=device).expand(rows, seq_len)
        if positions is None:
            positions = text
        if self.mrope or positions.dim() == 3:
            if positions.dim() == 2:
                positions = positions.expand(rows, seq_len)[None].expand(3, rows, seq_len)
            if positions.shape[0] == 3:
                positions = torch.cat([text[None], positions.expand(3, rows, seq_len)], dim=0)
        group = self.topology.sequence_parallel_group
        return shard_sequence(positions, group, layout=self.layout, dim=positions.dim() - 1)

    def _visual_rows(self, masks: torch.Tensor, features: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        """The rows of deepstack ``features`` (``[visual tokens, hidden]`` each, in the whole sequence's row-major
        order of ``masks [b, S]``) that fall in this rank's shard, in the shard's order."""
        if features is None:
            return None
        group = self.topology.sequence_parallel_group
        index = (torch.cumsum(masks.flatten().long(), 0) - 1).view(masks.shape)
        local = shard_sequence(masks, group, layout=self.layout, dim=1)
        rows = shard_sequence(index, group, layout=self.layout, dim=1)[local]
        return [feature[rows.to(feature.device)] for feature in features]


def model_inputs(model: nn.Module) -> frozenset[str]:
    """The inputs ``model.forward`` names (PEFT's wrapper: its base model's), ``**kwargs`` left out: what a processor
    makes for this family (``pixel_values``, ``image_grid_thw``, ``token_type_ids``, ...) is among them, and anything
    else would land in ``**kwargs``, which these models pass on without reading."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    parameters = inspect.signature(base.forward).parameters.values()
    return frozenset(p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


def _mrope(config: Any) -> bool:
    """Whether a text config uses multimodal RoPE (MRoPE: 3-D position ids)."""
    for name in ("rope_parameters", "rope_scaling"):
        parameters = getattr(config, name, None)
        if isinstance(parameters, Mapping) and "mrope_section" in parameters:
            return True
    return False


def vision_language(
    model: Any, topology: Any, layout: str, *, divide: bool = True, disable_in_eval: bool = False
) -> VisionLanguage | None:
    """A :class:`VisionLanguage` for ``model`` when it is a vision-language model instance, else ``None``.

    Raises:
        ValueError: a model with a vision tower's config whose language model cannot be found (naming the class), or
            whose language model cross-attends to the images (:func:`refuse_cross_attention`).
    """
    if not isinstance(model, nn.Module) or not _is_composite(getattr(model, "config", None)):
        return None
    found = find_language_model(model)
    if found is None:
        raise ValueError(
            f"{type(model).__name__} has a vision or audio tower, and ds_ring finds no language model in it (a "
            f"sub-model with the text config and decoder layers) before which to cut the sequence; train this model "
            f"without sequence parallelism"
        )
    refuse_cross_attention(type(model).__name__, *found)
    return VisionLanguage(model, *found, topology, layout, divide=divide, disable_in_eval=disable_in_eval)


def whole_image_mask(
    vision: VisionLanguage | None, original: Callable[..., Any] | None, own: Callable[..., Any]
) -> Callable[..., Any]:
    """The mask function for the registry: ``original`` for a vision-side config, and for every config while the
    language model runs whole (eval mode under ``disable_in_eval``); ``own`` otherwise."""
    if vision is None or original is None:
        return own

    def mask(*args: Any, config: Any = None, **kwargs: Any) -> Any:
        whole = vision.disable_in_eval and not vision.language_model.training
        if whole or vision.whole_mask(config):
            return original(*args, config=config, **kwargs)
        return own(*args, config=config, **kwargs)

    return mask
