"""An image-text model trained whole on one GPU: steps of rows that hold images (and a video clip), the vision tower
streamed as stages before the decoder's layers, beside the same model's steps on text alone (the same tokens, no
pixels) in the same call. Random weights, pixels and tokens; every state in host memory. Model TFLOPS count the
vision tower's work (its matrices on every patch, its window and full attention) as well as the decoder's.

    python benchmarks/image_text.py --model qwen2.5-vl-7b --rows 8 --seq-len 4096 --images-per-row 2 \
        --video-frames 8 --out $OUT/image-text-qwen2.5-vl-7b-h100.json
"""

import argparse
import gc
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import base_row, machine, table, timed, write_results  # noqa: E402
from throughput import BenchTrainer  # noqa: E402

from megatrain.config import Config, DataSection, EngineSection, ModelSection, PrecisionSection, TrainSection  # noqa: E402
from megatrain.step import StepBatch
from megatrain_zoo import flops_per_token  # noqa: E402
from megatrain_zoo.generic import generic_model_config  # noqa: E402

# Qwen2.5-VL-7B-Instruct's config.json (the published sizes)
QWEN2_5_VL_7B = dict(
    model_type="qwen2_5_vl",
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    max_position_embeddings=128000,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
    tie_word_embeddings=False,
    image_token_id=151655,
    video_token_id=151656,
    vision_start_token_id=151652,
    vision_end_token_id=151653,
    bos_token_id=151643,
    eos_token_id=151645,
    vision_config=dict(
        depth=32,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        in_chans=3,
        in_channels=3,
        out_hidden_size=3584,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[7, 15, 23, 31],
        hidden_act="silu",
    ),
)
# its shape shrunk, for a run on the CPU that checks the script
QWEN2_5_VL_TINY = QWEN2_5_VL_7B | dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
    vision_config=QWEN2_5_VL_7B["vision_config"]
    | dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, fullatt_block_indexes=[1]),
)
MODELS = {"qwen2.5-vl-7b": QWEN2_5_VL_7B, "qwen2.5-vl-tiny": QWEN2_5_VL_TINY}


def rows_with_media(args, hf: dict) -> tuple[torch.Tensor, torch.Tensor, list[dict], int]:
    """(input_ids, labels, each row's pixels, the step's patches): every row holds `images_per_row` images of
    `image_size`^2 pixels and a clip of `video_frames` frames, each between vision start and end tokens, text after."""
    vision = hf["vision_config"]
    patch, merge, temporal = vision["patch_size"], vision["spatial_merge_size"], vision["temporal_patch_size"]
    side = args.image_size // patch
    width = 3 * temporal * patch * patch
    ids = torch.randint(0, 150000, (args.rows, args.seq_len))
    media, patches = [], 0
    for row in range(args.rows):
        items = [("image", 1)] * args.images_per_row + (
            [("video", args.video_frames // temporal)] if args.video_frames else []
        )
        at, pixels = 1, {}
        for kind, t in items:
            tokens = t * side * side // merge**2
            ids[row, at] = hf["vision_start_token_id"]
            ids[row, at + 1 : at + 1 + tokens] = hf[f"{kind}_token_id"]
            ids[row, at + 1 + tokens] = hf["vision_end_token_id"]
            at += tokens + 2
            key = "pixel_values" if kind == "image" else "pixel_values_videos"
            grid = "image_grid_thw" if kind == "image" else "video_grid_thw"
            pixels.setdefault(key, []).append(torch.randn(t * side * side, width))
            pixels.setdefault(grid, []).append(torch.tensor([[t, side, side]]))
            patches += t * side * side
        if at >= args.seq_len:
            raise SystemExit(f"--seq-len {args.seq_len} holds no text after the row's images; raise it")
        media.append({k: torch.cat(v) for k, v in pixels.items()})
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    labels[labels >= hf["vision_start_token_id"]] = -100
    return ids, labels, media, patches


def vision_flops(hf: dict, args, patches: int) -> float:
    """The vision tower's training FLOPs of a step (forward, backward: 3x the forward's 2 per multiply-add): its
    blocks' matrices on every patch, the merger's on every merged token, attention over 8x8-patch windows in most
    blocks and over whole frames in the full-attention ones."""
    v = hf["vision_config"]
    d, ff, depth = v["hidden_size"], v["intermediate_size"], v["depth"]
    block_matrices = 4 * d * d + 3 * d * ff
    embed = 3 * v["temporal_patch_size"] * v["patch_size"] ** 2 * d
    merged = patches // v["spatial_merge_size"] ** 2
    merger = (4 * d) * (4 * d) + 4 * d * v["out_hidden_size"]
    window = (v["window_size"] // v["patch_size"]) ** 2
    frame = (args.image_size // v["patch_size"]) ** 2
    full = len(v["fullatt_block_indexes"])
    attention = 4 * d * patches * ((depth - full) * window + full * frame)  # (QK^T and AV, per query)
    forward = 2 * patches * (depth * block_matrices + embed) + 2 * merged * merger + attention
    return 3 * forward


def timed_steps(trainer, batch, steps: int) -> float:
    """Mean seconds of `steps` training steps on `batch` (after one untimed)."""
    trainer.train_step(StepBatch(*batch[:2], media=batch[2]))
    return timed(lambda: trainer.train_step(StepBatch(*batch[:2], media=batch[2])), steps)


def bench_config(args, freeze_vision_tower: bool) -> Config:
    train = TrainSection(
        steps=10**6,
        batch_size=args.rows,
        micro_batch_size=args.micro_batch,
        grad_clip=args.grad_clip,
        lr=1e-5,
        freeze_vision_tower=freeze_vision_tower,
    )
    return Config(
        model=ModelSection(preset="tiny"),  # (the model is given whole)
        data=DataSection(seq_len=args.seq_len),
        train=train,
        precision=PrecisionSection("auto"),
        engine=EngineSection(trace=bool(args.trace_dir)),
        device="auto",
        output_dir=tempfile.mkdtemp(),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-vl-7b")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--images-per-row", type=int, default=2)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--video-frames", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--grad-clip", type=float, default=0.0)
    parser.add_argument("--trace-dir", default=None, help="write a Chrome trace of each run's last step here")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    hf = MODELS[args.model]
    model = generic_model_config(hf, image_text=True)
    ids, labels, media, patches = rows_with_media(args, hf)
    items = f"{args.images_per_row} images of {args.image_size}^2 and a clip of {args.video_frames} frames per row"
    runs = [  # (scope, the tower frozen, the step's media)
        ("images and video, the whole model trained", False, media),
        ("images and video, the vision tower frozen", True, media),
        ("text alone", True, None),
    ]
    rows = []
    for frozen in (False, True):  # (a trainer each: the host holds one 8B model's state at a time)
        trainer = BenchTrainer(bench_config(args, frozen), model)
        for scope, _, step_media in (run for run in runs if run[1] == frozen):
            seconds = timed_steps(trainer, (ids, labels, step_media), args.steps)
            if args.trace_dir:
                slug = scope.replace(",", "").replace(" ", "-")
                trainer.timeline.write_chrome_trace(Path(args.trace_dir) / f"trace-{slug}.json")
            row = base_row("megatrain", args.model, model, args.seq_len, args.rows, args.micro_batch, seconds)
            work = flops_per_token(model, args.seq_len) * ids.numel()
            if step_media is not None:  # (a frozen tower runs forward only)
                work += vision_flops(hf, args, patches) / (3 if frozen else 1)
                row["note"] = f"{patches} patches ({items})"
            row |= {"scope": scope, "model_tflops": round(work / seconds / 1e12, 1)}
            row["placement"] = trainer.pipeline.executed.as_dict() if trainer.pipeline.executed else None
            rows.append(row)
            print(table([row], ["scope", "tokens_per_step", "step_time_s", "tokens_per_s", "model_tflops"]), flush=True)
        trainer.close()
        del trainer  # (its host memory, before the next trainer takes its own)
        gc.collect()
    payload = {
        "benchmark": f"{args.model} trained whole (vision tower streamed) on one GPU, against its text-only rate",
        "machine": machine(),
        "commands": ["python " + " ".join(sys.argv)],
        "notes": [
            "Random weights, pixels and tokens; every state in host memory (fp32 masters, AdamW moments); bf16 compute.",
            "model_tflops of the image rows count the vision tower's FLOPs (benchmarks/image_text.py vision_flops): "
            "forward and backward where it trains, its forward alone where it is frozen.",
        ],
        "results": rows,
    }
    write_results(Path(args.out), payload)


if __name__ == "__main__":
    main()
