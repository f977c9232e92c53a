"""A GRPO rollout's decoding step, variant by variant: ms a step and generated tokens/s for --sequences prompts of
--shortest-prompt to --prompt-len tokens (left-padded in one batch), --steps decoding steps sampled at temperature 1
from random weights resident on the GPU, and how many completions equal the first variant's. Variants: `grouped`
(megatrain's: a step's query over grouped key/value heads as they are, a dynamic KV cache whose layers grow in
place), `sdpa` (transformers' own SDPA attention), `cat` (transformers' own dynamic cache: each step copies each
layer's cache into a new tensor), `static` (a static KV cache, which transformers compiles the decoding step for on
CUDA, with CUDA graphs), `static-fused` (compiled without CUDA graphs: the weights and the cache may move between
rollouts) and `static-eager` (not compiled). Each variant generates --rollouts times from weights converted afresh,
as GRPO's steps do; all but the first are timed. `--profile`: the first variant's top CUDA kernels and host
operators over 16 steps.

    python benchmarks/decoding.py --model qwen2.5-1.5b --sequences 512 --steps 64 --out $OUT/decoding.json
"""

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).parent))
from block import profile_tables  # noqa: E402
from common import base_row, machine, table, write_results  # noqa: E402
from grpo import grpo_trainer, synchronize  # noqa: E402

from megatrain_zoo import preset  # noqa: E402
from megatrain_zoo.generate import GROUPED_DECODING, Generator, Sampling  # noqa: E402

# variant -> (the attention transformers' modules call, more `generate` options)
VARIANTS = {
    "grouped": (GROUPED_DECODING, {}),
    "sdpa": ("sdpa", {}),
    "cat": (GROUPED_DECODING, {"cache_implementation": "dynamic"}),
    "static": (GROUPED_DECODING, {"cache_implementation": "static"}),
    "static-fused": (GROUPED_DECODING, {"cache_implementation": "static", "compile_mode": "default"}),
    "static-eager": (GROUPED_DECODING, {"cache_implementation": "static", "disable_compile": True}),
}


def arguments():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-1.5b")
    parser.add_argument("--sequences", type=int, default=512, help="sequences decoded together")
    parser.add_argument("--prompt-len", type=int, default=128, help="the longest prompt")
    parser.add_argument("--shortest-prompt", type=int, help="the shortest prompt (default: half --prompt-len)")
    parser.add_argument("--steps", type=int, default=64, help="decoding steps timed (tokens a completion)")
    parser.add_argument("--rollouts", type=int, default=3, help="generations a variant (the first not timed)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--profile", action="store_true", help="the first variant's top kernels and operators")
    parser.add_argument("--out", default="benchmarks/results/decoding.json")
    parser.add_argument("--device", default="cuda", help="cuda (a CPU run checks the script only)")
    args = parser.parse_args()
    if args.rollouts < 2:
        parser.error(f"--rollouts {args.rollouts}: at least 2 (the first is not timed)")
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants {','.join(unknown)}: not one of {', '.join(VARIANTS)}")
    return args


def timed_generations(generator, prompts, steps: int, rollouts: int) -> tuple[list, list[float]]:
    """(the completions, the seconds of each generation after the first, which compiled and allocated what it needs;
    each converts the weights afresh, into new device tensors, as a GRPO step's rollout does)."""
    sampling = Sampling(max_new_tokens=steps, temperature=1.0)
    generator.generate(prompts, sampling, pad_id=0, seed=1)
    synchronize()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    seconds = []
    for _ in range(rollouts - 1):
        start = time.perf_counter()
        completions = generator.generate(prompts, sampling, pad_id=0, seed=1)
        synchronize()
        seconds.append(time.perf_counter() - start)
    return completions, seconds


def use_variant(generator, variant: str) -> None:
    from transformers.generation.configuration_utils import CompileConfig

    attention, options = VARIANTS[variant]
    generator.skeleton.config._attn_implementation = attention
    generator.generate_options = {k: v for k, v in options.items() if k != "compile_mode"}
    if "compile_mode" in options:
        generator.generate_options["compile_config"] = CompileConfig(mode=options["compile_mode"])


def variant_row(args, model, generator, prompts, variant: str, first: list | None) -> tuple[dict, list]:
    use_variant(generator, variant)
    attention, options = VARIANTS[variant]
    completions, seconds = timed_generations(generator, prompts, args.steps, args.rollouts)
    per_step = sum(seconds) / len(seconds) / args.steps
    row = base_row("megatrain", args.model, model, 1, len(prompts), generator.last_plan.batch, per_step)
    row |= {
        "scope": f"decoding step: {variant}",
        "seq_len": args.prompt_len + args.steps,
        "ms_per_step": round(1000 * per_step, 2),
        "ms_per_step_each_rollout": [round(1000 * s / args.steps, 2) for s in seconds],
        "model_tflops": None,
        "attention": attention,
        "generate_options": options,
        "prompt_lengths": [min(map(len, prompts)), max(map(len, prompts))],
        "same_completions_as_first": None if first is None else sum(a == b for a, b in zip(completions, first)),
    }
    print(f"{variant}: {row['ms_per_step']} ms a step, {row['tokens_per_s']:,} tokens/s", file=sys.stderr)
    return row, completions


def main():
    args = arguments()
    model = preset(args.model)
    trainer_args = SimpleNamespace(
        model=args.model, prompts=1, generations=2, prompt_len=args.prompt_len,
        completion_len=args.steps, micro_batch=1, grad_clip=1.0, device=args.device,
    )  # fmt: skip
    trainer = grpo_trainer(trainer_args, model)
    generator = Generator(trainer, weights="resident")
    shortest = args.prompt_len // 2 if args.shortest_prompt is None else args.shortest_prompt
    lengths = torch.randint(shortest, args.prompt_len + 1, (args.sequences,)).tolist()
    prompts = [torch.randint(3, model.vocab_size, (n,)).tolist() for n in lengths]
    rows, first = [], None
    for variant in args.variants.split(","):
        row, completions = variant_row(args, model, generator, prompts, variant, first)
        rows.append(row)
        first = completions if first is None else first
    notes = [
        "A row times one decoding step of every sequence (step_time_s; tokens_per_step: the sequences), "
        "sampled at temperature 1 by megatrain's row-keyed sampler, the weights resident in bf16; "
        "same_completions_as_first: how many of its completions equal the first variant's, token for token; a row's "
        "time is a whole `generate` over its steps, the weights' copy to the GPU and the prompts' pass included"
    ]
    if args.profile and args.device == "cuda":  # (16 decoding steps, three times)
        use_variant(generator, args.variants.split(",")[0])
        sixteen = Sampling(max_new_tokens=16, temperature=1.0)
        rows[0]["profile"], rows[0]["host_profile"], rows[0]["gpu_gaps"] = profile_tables(
            lambda: generator.generate(prompts, sixteen, 0)
        )
    trainer.close()
    payload = {
        "benchmark": (
            f"A GRPO rollout's decoding step: {args.model}, {args.sequences} sequences of {shortest}-"
            f"{args.prompt_len}-token prompts, {args.steps} steps"
        ),
        "machine": machine(),
        "commands": [" ".join(["python", *sys.argv])],
        "notes": notes,
        "results": rows,
    }
    write_results(Path(args.out), payload)
    print(table(rows, ["scope", "ms_per_step", "tokens_per_s", "same_completions_as_first"]))


if __name__ == "__main__":
    main()
