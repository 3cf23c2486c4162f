"""A tiny Qwen2.5-VL trained on one long video-like sequence, sequence-parallel over the ranks: its memory per rank.

The model is built from ``Qwen2_5_VLConfig`` with random weights (nothing is downloaded): a text decoder of ``--dim``
hidden, 2 layers, 4 heads / 2 K/V heads, and a 2-layer vision encoder of hidden 32 with 2 × 2 patches (window
attention, its MRoPE position ids computed by the model from the whole sequence). Each step's sample is one row of
``--seq`` tokens: a short prompt, then a video of ``frames`` temporal patches of ``--grid`` × ``--grid`` patches
(``grid² / 4`` tokens per frame after the merge) filling the sequence, then a few text tokens. ds_ring runs the
model's merge on the whole sequence and cuts it before the language model (:mod:`ds_ring.integrations.hf.vision`);
the vision encoder's frames are divided over the ranks unless ``--whole-vision``.

Launch (2 CPU ranks)::

    torchrun --standalone --nproc-per-node 2 launch/train_vlm.py --seq 65536
    torchrun --standalone --nproc-per-node 2 launch/train_vlm.py --seq 65536 --whole-vision

Each rank prints its peak resident memory (the whole process), the bytes its vision encoder saved for backward in the
last step, and its time per step.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python launch/train_vlm.py` from a checkout
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

from ds_ring.integrations.hf import causal_lm_loss, register_with_transformers, shard_batch  # noqa: E402

IMAGE, VIDEO, START, END = 5, 6, 3, 4


class SavedActivations:
    """Bytes of the distinct storages a module's forward saves for backward (autograd's saved tensors) other than its
    parameters, per call: the activations the module keeps until the backward."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.calls: list[int] = []
        self._seen: dict[int, int] = {}
        self._parameters = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self._hooks: Any = None
        self._handles = [
            module.register_forward_pre_hook(self._enter),
            module.register_forward_hook(self._leave, always_call=True),
        ]

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._parameters:
            self._seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    def _enter(self, *_: Any) -> None:
        self._seen = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()

    def _leave(self, *_: Any) -> None:
        self._hooks.__exit__(None, None, None)
        self.calls.append(sum(self._seen.values()))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=2 * args.dim, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * args.seq, use_cache=False,
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0,
                             "mrope_section": [args.dim // 32, 3 * args.dim // 64, 3 * args.dim // 64]},
        ),
        vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=2, temporal_patch_size=2,
            spatial_merge_size=2, window_size=8, fullatt_block_indexes=[1], out_hidden_size=args.dim,
        ),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
    )  # fmt: skip
    torch.manual_seed(args.seed)
    return Qwen2_5_VLForConditionalGeneration._from_config(config, attn_implementation="sdpa").train()


def video_sample(args: argparse.Namespace, step: int) -> dict[str, torch.Tensor]:
    """One row of ``--seq`` tokens: 32 prompt tokens, a video filling the rest but 32, then text."""
    generator = torch.Generator().manual_seed(args.seed + step)
    per_frame = args.grid * args.grid // 4
    frames = (args.seq - 64) // per_frame
    start = 32
    input_ids = torch.randint(8, args.vocab, (1, args.seq), generator=generator)
    kinds = torch.zeros(1, args.seq, dtype=torch.long)
    input_ids[0, start - 1] = START
    input_ids[0, start : start + frames * per_frame] = VIDEO
    input_ids[0, start + frames * per_frame] = END
    kinds[0, start : start + frames * per_frame] = 2
    patches = frames * args.grid * args.grid
    return {
        "input_ids": input_ids,
        "labels": input_ids.masked_fill(kinds > 0, -100),
        "mm_token_type_ids": kinds,
        "pixel_values_videos": torch.randn(patches, 3 * 2 * 2 * 2, generator=generator),
        "video_grid_thw": torch.tensor([[frames, args.grid, args.grid]]),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=65536, help="tokens per sequence")
    p.add_argument("--grid", type=int, default=16, help="patches per side of a frame (grid² / 4 tokens per frame)")
    p.add_argument("--dim", type=int, default=64, help="the text decoder's hidden size (a multiple of 64)")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--whole-vision", action="store_true", help="every rank encodes every frame (no division)")
    p.add_argument("--strategy", default="ring", help="ring_attention.strategy (ring, all_gather, ulysses)")
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build_model(args)
    section = {"strategy": args.strategy, **({"ulysses_degree": 2} if args.strategy == "ulysses" else {})}
    session = register_with_transformers(model, config={"ring_attention": section}, divide_vision=not args.whole_vision)
    group = session.topology.sequence_parallel_group
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    vision = SavedActivations(model.model.visual)
    losses, times = [], []
    for step in range(args.steps):
        started = time.perf_counter()
        batch = shard_batch(session, video_sample(args, step))
        logits = model(**{k: v for k, v in batch.items() if k != "shift_labels"}).logits
        loss = causal_lm_loss(session, logits, batch["shift_labels"])
        loss.backward()
        for parameter in model.parameters():  # each rank's gradient is its tokens' share: the group's sum is whole
            if parameter.grad is not None:
                dist.all_reduce(parameter.grad, group=group)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        times.append(time.perf_counter() - started)
    vision.remove()
    session.close()
    rank, world = dist.get_rank(), dist.get_world_size()
    report = {
        "rank": rank,
        "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "vision_saved_mib": vision.calls[-1] / 2**20,
        "step_s": min(times),
    }
    reports = [None] * world
    dist.all_gather_object(reports, report)
    if rank == 0:
        frames = (args.seq - 64) // (args.grid * args.grid // 4)
        mode = "every rank encodes every frame" if args.whole_vision else "frames divided over the ranks"
        print(f"{args.seq} tokens ({frames} frames of {args.grid}x{args.grid} patches) on {world} ranks, "
              f"{args.strategy}, {mode}; loss {losses[0]:.3f} -> {losses[-1]:.3f}")  # fmt: skip
        for r in reports:
            print(f"  rank {r['rank']}: peak memory {r['peak_mib']:8.1f} MiB | vision saved for backward "
                  f"{r['vision_saved_mib']:7.1f} MiB | {r['step_s']:.1f} s per step")  # fmt: skip
    dist.destroy_process_group()
    return {"losses": losses, "reports": reports}


if __name__ == "__main__":
    main()
