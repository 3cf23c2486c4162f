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
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ds_ring.integrations.hf.vision_split import FrameSplit, frame_encoders
from ds_ring.integrations.internal import shard_sequence

__all__ = [
    "VisionLanguage",
    "cut_point",
    "find_language_model",
    "model_inputs",
    "refuse_cross_attention",
    "refuse_decoder_inputs",
    "refuse_encoder_decoder",
    "refuse_merge_inside",
    "towers",
    "vision_language",
    "whole_image_mask",
]


def _is_composite(config: Any) -> bool:
    """Whether ``config`` is a multimodal model's: a vision (or audio) tower's config nested in it, or its text model's
    config nested in it (Fuyu: the image patches go through one linear layer, which has no config, into a language
    model built from ``text_config``)."""
    from transformers import PretrainedConfig

    if any(isinstance(getattr(config, name, None), PretrainedConfig) for name in ("vision_config", "audio_config")):
        return True
    return isinstance(getattr(config, "text_config", None), PretrainedConfig)


def refuse_encoder_decoder(config: Any) -> None:
    """``ValueError`` for an encoder-decoder model: Florence-2, Pix2Struct, T5Gemma 2, a ``VisionEncoderDecoderModel``,
    UDOP (its image patches embedded inside its text encoder, no tower's config nested), ...

    Its config says ``is_encoder_decoder`` (and may nest the encoder's config: ``vision_config``, ``audio_config`` or an
    ``encoder`` config). ds_ring shards one decoder-only sequence, cut after the image features are merged into it;
    such a model has no such sequence: its decoder cross-attends to the encoder's whole output (keys that are not a
    shard of the decoder's sequence) and its encoder attends bidirectionally, so neither runs sequence-parallel as a
    causal language model does.
    """
    from transformers import PretrainedConfig

    if config is None or not getattr(config, "is_encoder_decoder", False):
        return
    nested = [
        n
        for n in ("vision_config", "audio_config", "encoder")
        if isinstance(getattr(config, n, None), PretrainedConfig)
    ]
    where = f", its encoder's config in {nested[0]}" if nested else ""
    raise ValueError(
        f"{type(config).__name__} is an encoder-decoder model (is_encoder_decoder{where}): its decoder cross-attends "
        f"to the encoder's whole output, which is not a shard of the decoder's sequence, and ds_ring shards only a "
        f"decoder-only sequence with the images merged into it; train this model without sequence parallelism"
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


def refuse_cross_attention(
    model_class: str, path: str, language_model: nn.Module, towers_inside: Sequence[nn.Module] = ()
) -> None:
    """``ValueError`` for a language model with cross-attention layers (Mllama): their keys are the image features,
    which are not a shard of the sequence, so ds_ring's attention would exchange them over the ranks as if they were;
    found by the module's name or class (``cross_attn``, ``encoder_attn``, ``...CrossAttention``), outside
    ``towers_inside`` (Chameleon's VQ-VAE inside its decoder's module: its ``EncoderAttnBlock`` attends over pixels)."""
    skipped = {id(m) for tower in towers_inside for m in tower.modules()}
    for name, module in language_model.named_modules():
        if id(module) in skipped:
            continue
        if _CROSS_ATTENTION.search(name.rsplit(".", 1)[-1]) or _CROSS_ATTENTION.search(type(module).__name__):
            raise ValueError(
                f"{model_class}'s language model ({path}) cross-attends to the image features "
                f"({type(module).__name__} at {path}.{name}): its keys are not a shard of the sequence, and ds_ring "
                f"shards only a sequence with the images merged into it; train this model without sequence "
                f"parallelism"
            )


def towers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The sub-models of ``model`` built from a config of their own, neither the model's nor its text model's: an image
    tower however its config is named (Chameleon's and Emu3's VQ-VAE in ``vq_config``, Evolla's protein encoder, GIT's
    vision model), with their paths."""
    from transformers import PreTrainedModel

    config = getattr(model, "config", None)
    if config is None:
        return []
    try:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
    except ValueError:  # several text configs (an encoder-decoder's): none of them is a tower
        text = config
    return [
        (path, module)
        for path, module in model.named_modules()
        if isinstance(module, PreTrainedModel) and getattr(module, "config", None) not in (None, config, text)
    ]


def refuse_merge_inside(model: nn.Module, path: str, language_model: nn.Module) -> None:
    """``ValueError`` for a model whose decoder layers run in the module built from the model's own config (no nested
    text config) while it holds a tower (Chameleon): that module takes the tower's output in itself (merges
    it at the image tokens, or attends to it), so no call before the decoder takes only the merged embeddings, and
    cutting its call into shards would cut the sequence before the merge."""
    if getattr(language_model, "config", None) is not getattr(model, "config", None):
        return
    held = towers(model)
    where = f" ({held[0][0]}, built from {type(held[0][1].config).__name__})" if held else ""
    raise ValueError(
        f"{type(model).__name__} has a tower{where} and no language model of its own: its decoder layers run in "
        f"{path}, built from the model's own config, which also takes in the tower's output (merged into the "
        f"sequence, or attended to), so there is no call taking only the merged embeddings before which ds_ring "
        f"could cut this rank's rows; train this model without sequence parallelism"
    )


def find_language_model(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The language model of a vision-language model instance (its path and module): the sub-model whose config is
    the model's text config and that holds the decoder layers; ``None`` for a model without a tower (a tower's config
    nested in its config, or a sub-model built from a config of its own: :func:`towers`) or without such a
    sub-model."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        return None
    if not _is_composite(config) and not towers(model):
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
        self.mrope_axes = max((len(m.mrope_section) for m in language_model.modules() if _sections(m)), default=0)
        """How many MRoPE axes the language model reads (0: none): its rotary's ``mrope_section`` has one section
        per axis (3 for Qwen's, 4 for HunYuan-VL's XD-RoPE). Decided from its modules, not its config, whose
        ``rope_parameters`` may name sections its rotary never reads (EXAONE 4.5's 1-D RoPE text model)."""
        self.mrope = self.mrope_axes > 0
        self._handed: torch.Tensor | None = None
        """The position ids the last cut handed the language model (this rank's rows; MRoPE's ``[4, b, s/p]``)."""
        self._text: torch.Tensor | None = None
        """This rank's rows ``[b, s/p]`` of the last cut's text positions (``arange(S)`` per row)."""
        self.batch: dict[str, torch.Tensor] = {}
        """While the language model runs (cut): ``position_ids [b, S/p]``, this rank's rows of the whole sequence's
        text positions, for attention calls whose decoder layer passes none on (Cohere Compass hands its layers only
        the rotary embeddings); the attention's own keyword arguments take precedence."""
        self._handles = [
            language_model.register_forward_pre_hook(self._cut, with_kwargs=True),
            language_model.register_forward_hook(self._uncut, always_call=True),
        ]
        outside = [m for m in model.modules() if id(m) not in inside]
        encoders = frame_encoders(outside) if divide else []
        self.splits = [FrameSplit(encoder, topology, disable_in_eval=disable_in_eval) for encoder in encoders]
        """The vision encoders whose frames are divided over the ranks."""

    def remove(self) -> None:
        """Take the hooks off the language model and the vision encoders."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
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
        flags = [
            v.reshape(rows, seq_len, -1)[..., 0]
            for v in kwargs.values()
            if isinstance(v, torch.Tensor) and v.dtype == torch.bool and v.dim() >= 2 and v.shape[:2] == (rows, seq_len)
        ]
        for key, value in kwargs.items():
            if key in cut and cut[key] is not value:
                continue
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (rows, seq_len):
                cut[key] = shard_sequence(value, group, layout=self.layout, dim=1)
            elif key != "attention_mask" and _features(value):  # a mask per layer type (Gemma 3's) is a mask
                cut[key] = self._feature_rows(key, value, flags, rows, seq_len)
        positions = cut["position_ids"]
        self.batch = {"position_ids": self._text if positions.dim() == 3 else positions}
        return (), cut

    def _uncut(self, _module: nn.Module, _args: tuple, _output: Any) -> None:
        self.batch = {}

    def _feature_rows(self, key: str, value: Any, flags: list[torch.Tensor], rows: int, seq_len: int) -> Any:
        """This rank's rows of ``value`` (a tensor, or a list / tuple / dict of them, each ``[image tokens, ...]``):
        features the language model adds at the image tokens (Granite 4 Vision's deepstack ``{layer: [n, hidden]}``),
        in the row-major order of the one boolean mask ``[b, S, ...]`` of them it is also given (``flags``).

        Raises:
            ValueError: no such mask, or rows that do not count its image tokens: the language model merges the
                features into the sequence itself and ds_ring cannot tell which rows are this rank's.
        """
        tensors = list(value.values()) if isinstance(value, dict) else [value] if torch.is_tensor(value) else value
        count = int(flags[0].sum()) if len(flags) == 1 else -1
        if count < 0 or any(t.shape[0] != count for t in tensors):
            shapes = [list(t.shape) for t in tensors][:3]
            raise ValueError(
                f"{self.model_class} calls its language model ({self.path}) with {key} of shape "
                f"{shapes[0] if torch.is_tensor(value) else shapes}, not a sequence of this batch ([{rows}, {seq_len}, "
                f"...]) nor one row per image token of a boolean mask it is given: the language model merges it into "
                f"the sequence itself (image features at their placeholders), after the point where ds_ring cuts the "
                f"sequence into this rank's rows, and ds_ring cannot tell which of its rows fall in this rank's shard; "
                f"train this model without sequence parallelism"
            )
        kept = self._visual_rows(flags[0], tensors)
        if isinstance(value, dict):
            return dict(zip(value, kept, strict=True))
        return kept[0] if torch.is_tensor(value) else type(value)(kept)

    def _positions(self, positions: torch.Tensor | None, rows: int, seq_len: int, device: torch.device) -> torch.Tensor:
        """This rank's rows of the whole sequence's position ids.

        ``None`` (the model computed none: every family without MRoPE) is ``arange(S)``, which the language model
        would otherwise make of the shard's own length. MRoPE ids of 3 axes (``[3, b, S]`` from ``get_rope_index``)
        get the text row transformers' language models read as the attention's ``position_ids`` and strip before
        their rotary (``[4, b, S]``, row 0 ``arange(S)``: one document per row); without it they would pass the
        attention none. Ids of another count of axes (:attr:`mrope_axes`: HunYuan-VL's 4) have no such convention
        (HunYuan-VL's language model raises on a fifth row) and go as they are: their language model passes its
        attention no positions, and the attention reads the cut's text row (:attr:`batch`).
        """
        text = torch.arange(seq_len, device=device).expand(rows, seq_len)
        if positions is None:
            positions = text
        if self.mrope or positions.dim() == 3:
            axes = self.mrope_axes or 3
            if positions.dim() == 2:
                positions = positions.expand(rows, seq_len)[None].expand(axes, rows, seq_len)
            if positions.shape[0] == 3 == axes:
                positions = torch.cat([text[None], positions.expand(axes, rows, seq_len)], dim=0)
        group = self.topology.sequence_parallel_group
        self._text = shard_sequence(text, group, layout=self.layout, dim=1)
        self._handed = shard_sequence(positions, group, layout=self.layout, dim=positions.dim() - 1)
        return self._handed

    def text_positions(self, positions: torch.Tensor) -> torch.Tensor | None:
        """This rank's text positions ``[b, s/p]`` of the last cut, for the ``positions`` a decoder layer passes its
        attention when they are MRoPE ids the cut handed the language model: their rows ``[axes, b, s/p]``
        (GLM-4V-MoE's language model hands its layers those, having read its rotary from them). ``None`` for anything
        else. (A layer that passes none, HunYuan-VL's, gets the text positions from :attr:`batch`.)"""
        handed = self._handed
        if handed is None or handed.dim() != 3:
            return None
        if positions.dim() != 3 or handed.shape[0] < positions.shape[0]:
            return None
        rows = handed[handed.shape[0] - positions.shape[0] :]
        if not torch.equal(rows.to(positions.device), positions):
            return None
        return self._text

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


def _features(value: Any) -> bool:
    """Whether ``value`` is a floating tensor of 2 dimensions or more, or a non-empty list / tuple / dict of such
    tensors: features. Integer tensors are ids and labels (the Trainer's ``shift_labels``, already this rank's rows,
    reach the language model through ``**kwargs``) and pass as they are."""

    def feature(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.dim() >= 2 and t.is_floating_point()

    if isinstance(value, torch.Tensor):
        return feature(value)
    items = list(value.values()) if isinstance(value, dict) else value if isinstance(value, list | tuple) else []
    return bool(items) and all(feature(t) for t in items)


def _sections(module: nn.Module) -> bool:
    """Whether ``module`` has MRoPE sections (HunYuan-VL's attention has ``mrope_section = None`` without them)."""
    return isinstance(getattr(module, "mrope_section", None), list | tuple)


def model_inputs(model: nn.Module) -> frozenset[str]:
    """The inputs ``model.forward`` names (PEFT's wrapper: its base model's), ``**kwargs`` left out: what a processor
    makes for this family (``pixel_values``, ``image_grid_thw``, ``token_type_ids``, ...) is among them, and anything
    else would land in ``**kwargs``, which these models pass on without reading."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    parameters = inspect.signature(base.forward).parameters.values()
    return frozenset(p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


def cut_point(model: Any) -> tuple[str, nn.Module] | None:
    """Where ds_ring cuts a multimodal model instance's sequence: its language model (path, module), ``None`` for a
    text model (no tower: :func:`towers`, :func:`_is_composite`). Cheap (a walk over the modules), so registration
    calls it before it probes the model.

    Raises:
        ValueError: a model with a vision tower's config whose language model cannot be found (naming the class),
            whose decoder takes the tower's output in itself (:func:`refuse_merge_inside`), or whose language model
            cross-attends to the images (:func:`refuse_cross_attention`).
    """
    if not isinstance(model, nn.Module) or getattr(model, "config", None) is None:
        return None
    held = towers(model)
    # a vision-language model inside (Pi0's PaliGemma, whose cache its action expert attends to) makes it one too
    composite = _is_composite(model.config) or any(_is_composite(getattr(t, "config", None)) for _, t in held)
    if not composite and not held:
        return None
    found = find_language_model(model)
    if found is None and not composite:  # sub-models of a text model (BLT's byte encoder): no decoder they feed
        return None
    if found is None:
        raise ValueError(
            f"{type(model).__name__} has a vision or audio tower, and ds_ring finds no language model in it (a "
            f"sub-model with the text config and decoder layers) before which to cut the sequence; train this model "
            f"without sequence parallelism"
        )
    inside = {id(m) for m in found[1].modules()}
    refuse_cross_attention(type(model).__name__, *found, [t for _, t in held if id(t) in inside])
    refuse_merge_inside(model, *found)
    return found


def vision_language(
    model: Any, topology: Any, layout: str, *, divide: bool = True, disable_in_eval: bool = False
) -> VisionLanguage | None:
    """A :class:`VisionLanguage` for ``model`` when it is a vision-language model instance (:func:`cut_point`), else
    ``None``.

    Raises:
        ValueError: what :func:`cut_point` refuses.
    """
    found = cut_point(model)
    if found is None:
        return None
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
