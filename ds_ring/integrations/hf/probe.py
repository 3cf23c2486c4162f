"""Which modules of a model mix information along the sequence other than through the attention interface, measured.

The registered attention (``ALL_ATTENTION_FUNCTIONS[implementation]``) is what ds_ring replaces; everything else a
model does must be position-wise, or be a layer ds_ring runs sequence-parallel itself. :func:`probe_sequence_mixers`
checks that by behaviour, whatever a module is called: it runs the model once on a few random tokens with that
attention replaced by a position-wise stand-in (each token's output is its own value vector), and for every module
that ran it takes one vector-Jacobian product of the module's output at the middle position with respect to each of
its inputs. A position-wise module gives exactly zero at every other position; a convolution, a scan, a cumulative
sum, a token shift or attention computed in the module's own code does not. Of the modules that mix, the ones whose
mixing a descendant explains (a mixing child, a layer ds_ring runs sequence-parallel, a class the user declared
position-wise) are not reported: what is reported is where the mixing happens.

The probe reads values, not code: a dependency whose weights are exactly zero at the probe (a zero-initialised
projection feeding the mixer) is not seen. The class-name filter of
:func:`~ds_ring.integrations.hf.audit.refuse_sequence_mixers` still covers modules the probe did not run or could not
read, and :class:`~ds_ring.integrations.hf.audit.CallAudit` is the backstop on the first forward.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ds_ring.integrations.internal import Patch, set_item, undo_all

__all__ = ["Mixer", "Probe", "probe_sequence_mixers", "PROBE_TOKENS"]

PROBE_TOKENS = 48
"""The probe's sequence length before it is made a multiple of the config's ``*chunk_size`` fields (scan kernels
that want whole chunks) and distinct from the config's other sizes (the sequence dim is found by its length)."""

_POSITION_WISE_TYPES = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm, nn.Dropout, nn.Identity)
"""torch layers position-wise by construction: not probed (their cost is most of the model's modules)."""


@dataclass(frozen=True)
class Mixer:
    """A module that mixes along the sequence by itself: ``path`` in the model, the module, and ``owner``: the
    nearest enclosing class that is not a torch layer, when the module itself is one (``nn.Conv1d`` of a mixer)."""

    path: str
    module: nn.Module
    owner: str | None = None

    def describe(self) -> str:
        cls = type(self.module).__name__
        return f"{cls} in {self.owner} (at {self.path})" if self.owner else f"{cls} (at {self.path or 'the model'})"


@dataclass
class Probe:
    """The probe's findings: ``probed`` the ids of the modules it ran and read; ``mixers`` those that mix by
    themselves (none explained by a descendant), in the order they ran; ``tokens`` the probe's length."""

    tokens: int
    probed: set[int] = field(default_factory=set)
    mixers: list[Mixer] = field(default_factory=list)


def _probe_length(config: Any) -> int:
    sizes = {v for k, v in vars(config).items() if isinstance(v, int) and not isinstance(v, bool) and v > 1}
    chunks = [v for k, v in vars(config).items() if "chunk_size" in k and isinstance(v, int) and v > 1]
    step = math.lcm(PROBE_TOKENS, *chunks)
    length = step
    while length in sizes:
        length += step
    return length


def _cannot_run(model: nn.Module) -> str | None:
    """Why the model cannot run a probe forward here (parameters on the meta device, or partitioned by ZeRO 3)."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_meta:
            return f"{name} is on the meta device"
        if hasattr(tensor, "ds_id"):
            return f"{name} is partitioned by DeepSpeed ZeRO 3"
    return None


def _stand_in(_module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_: Any,
              **__: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
    """Position-wise attention: each token's output is its own value (``[b, s, heads, d_v]``, K/V heads repeated)."""
    value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    return value.transpose(1, 2), None


@contextlib.contextmanager
def _attention_standing_in(implementations: Iterable[str]) -> Iterator[None]:
    """While open, ``ALL_ATTENTION_FUNCTIONS[name]`` is the position-wise stand-in for each name (a name with no
    mask function gets sdpa's, so that the model builds one)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    undo: list[Patch] = []
    try:
        for name in implementations:
            undo.append(set_item(ALL_ATTENTION_FUNCTIONS._local_mapping, name, _stand_in, library="transformers"))
            masks = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
            if name not in ALL_MASK_ATTENTION_FUNCTIONS:
                undo.append(set_item(masks, name, masks["sdpa"], library="transformers"))
        yield
    finally:
        undo_all(undo)


def _sequence_dim(tensor: Any, length: int) -> int | None:
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        return None
    dims = [d for d, size in enumerate(tensor.shape) if size == length]
    return dims[0] if len(dims) == 1 else None


def _first_tensor(output: Any) -> Any:
    while isinstance(output, tuple | list) and output:
        output = output[0]
    if hasattr(output, "to_tuple"):  # a ModelOutput
        return _first_tensor(output.to_tuple())
    return output


def _mixes(output: torch.Tensor, out_dim: int, inputs: list[tuple[torch.Tensor, int]], length: int) -> bool | None:
    """Whether ``output`` at the middle position depends on any input at another position (``None``: unreadable,
    e.g. an input modified in place)."""
    if not output.requires_grad:  # depends on no input's values (a rotary table reading only a dtype)
        return False
    middle = length // 2
    cotangent = torch.zeros_like(output)
    generator = torch.Generator(device=output.device).manual_seed(0)
    selected = cotangent.select(out_dim, middle)
    selected.copy_(torch.randn(selected.shape, generator=generator, device=output.device, dtype=output.dtype))
    try:
        grads = torch.autograd.grad(output, [x for x, _ in inputs], cotangent, retain_graph=True, allow_unused=True)
    except RuntimeError:
        return None
    for grad, (_, dim) in zip(grads, inputs, strict=True):
        if grad is None:
            continue
        others = torch.cat([grad.narrow(dim, 0, middle), grad.narrow(dim, middle + 1, length - middle - 1)], dim)
        if float(others.abs().max()) > 0:
            return True
    return False


def _forward_kwargs(model: nn.Module, input_ids: torch.Tensor) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"input_ids": input_ids}
    parameters = inspect.signature(model.forward).parameters
    if "use_cache" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        kwargs["use_cache"] = False
    return kwargs


def probe_sequence_mixers(
    model: nn.Module,
    implementations: Iterable[str],
    skip: Callable[[nn.Module], bool],
) -> Probe | str:
    """Run ``model`` once on random tokens, attention standing in position-wise; find who mixes the sequence.

    Args:
        model: a transformers model instance (its parameters are read, never changed; its gradients untouched).
        implementations: the attention registry entries ds_ring will replace (they stand in during the probe).
        skip: modules not to read, whose mixing explains their ancestors' (the layers ds_ring runs
            sequence-parallel, classes declared position-wise); their descendants are not read either.

    Returns:
        The :class:`Probe`, or why it could not run (a string: the caller falls back to class names).
    """
    why = _cannot_run(model)
    if why is not None:
        return why
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    length = _probe_length(text) if text is not None else PROBE_TOKENS
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    if vocab < 2:
        return "the model's config has no vocab_size to draw probe tokens from"
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    tokens = torch.randint(min(3, vocab - 1), vocab, (1, length), generator=torch.Generator().manual_seed(0))

    skipped = {id(m) for root in model.modules() if skip(root) for m in root.modules()}
    explaining = {id(root) for root in model.modules() if skip(root)}
    calls: dict[int, tuple[nn.Module, list[tuple[torch.Tensor, int]], Any]] = {}
    order: list[int] = []

    def enter(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
        # each input x becomes x + z, z a zero leaf of this call alone: the gradient on z is the module's own
        # Jacobian, not one through another input computed from x outside it (a residual beside an attention)
        if id(module) in calls or id(module) in skipped or isinstance(module, _POSITION_WISE_TYPES):
            return None
        inputs: list[tuple[torch.Tensor, int]] = []

        def fresh(x: Any) -> Any:
            dim = _sequence_dim(x, length)
            if dim is None:
                return x
            leaf = torch.zeros_like(x, requires_grad=True)
            inputs.append((leaf, dim))
            return x + leaf

        args, kwargs = tuple(fresh(x) for x in args), {k: fresh(x) for k, x in kwargs.items()}
        calls[id(module)] = (module, inputs, None)
        order.append(id(module))
        return args, kwargs

    def leave(module: nn.Module, _args: tuple, output: Any) -> None:
        call = calls.get(id(module))
        if call is not None and call[2] is None:
            calls[id(module)] = (module, call[1], _first_tensor(output))

    handles = [m.register_forward_pre_hook(enter, with_kwargs=True) for m in model.modules()]
    handles += [m.register_forward_hook(leave) for m in model.modules()]
    modes = {id(m): m.training for m in model.modules()}
    model.eval()  # no dropout, no activation checkpointing (its reentrant form would hide the graph)
    try:
        with torch.enable_grad(), _attention_standing_in(implementations):
            model(**_forward_kwargs(model, tokens.to(device)))
    except Exception as err:  # noqa: BLE001 - any failure of a forward ds_ring made up: fall back to names
        return f"the probe forward raised {type(err).__name__}: {str(err)[:200]}"
    finally:
        for handle in handles:
            handle.remove()
        for module in model.modules():
            module.training = modes.get(id(module), module.training)

    probe = Probe(tokens=length)
    mixing: set[int] = set()
    for key in order:
        _, inputs, output = calls[key]
        out_dim = _sequence_dim(output, length)
        if out_dim is None or not inputs:
            continue
        mixes = _mixes(output, out_dim, inputs, length)
        if mixes is None:
            continue
        probe.probed.add(key)
        if mixes:
            mixing.add(key)
    calls.clear()  # the graph's tensors
    return _innermost(model, probe, mixing, explaining)


def _innermost(model: nn.Module, probe: Probe, mixing: set[int], explaining: set[int]) -> Probe:
    """Keep the mixing modules no mixing or explaining descendant accounts for; a torch layer among them is named
    with its nearest enclosing non-torch class (reported in its stead when that one mixes too)."""
    named = list(model.named_modules())
    for path, module in named:
        if id(module) not in mixing:
            continue
        below = [m for p, m in named if p.startswith(f"{path}.") or (not path and m is not module)]
        if any(id(m) in mixing or id(m) in explaining for m in below):
            continue
        owner_path, owner = _owner(named, path)
        torch_layer = type(module).__module__.startswith("torch.nn") and owner is not None
        if torch_layer and id(owner) in mixing:
            found = Mixer(owner_path, owner)
        else:
            found = Mixer(path, module, type(owner).__name__ if torch_layer else None)
        if all(m.module is not found.module for m in probe.mixers):
            probe.mixers.append(found)
    return probe


def _owner(named: list[tuple[str, nn.Module]], path: str) -> tuple[str, nn.Module | None]:
    """The nearest ancestor of ``path`` whose class is not a torch layer."""
    by_path = dict(named)
    parts = path.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        parent = ".".join(parts[:cut])
        module = by_path.get(parent)
        if module is not None and not type(module).__module__.startswith("torch.nn"):
            return parent, module
    return "", None
