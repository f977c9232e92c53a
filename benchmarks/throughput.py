"""Training throughput of megatrain on one GPU, with plain PyTorch in the same run as the baseline.

megatrain keeps every parameter, gradient and AdamW moment in host memory; the baseline
(Hugging Face transformers' implementation of the same model, fp32 master weights and
AdamW state on the GPU, bf16 autocast, per-layer activation checkpointing, fused AdamW)
runs wherever it fits in GPU memory. Model TFLOPS = (6 x matmul params + causal attention)
x tokens / step time, recomputation not counted. Results: JSON (--out) and a table.

    python benchmarks/throughput.py --models llama3.2-1b,llama3.2-3b,qwen2.5-7b \
        --seq-len 2048 --tokens 32768,65536,131072 --out benchmarks/results/throughput-h100.json
"""

import argparse
import functools
import gc
import itertools
import resource
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    ADAMW_BYTES_PER_PARAM,
    STEADY_STATE,
    base_row,
    fill_random_,
    machine,
    steady_steps,
    table,
    timed,
    write_results,
)

from megatrain import Trainer  # noqa: E402
from megatrain.config import (  # noqa: E402
    AdapterSection,
    Config,
    DataSection,
    EngineSection,
    ModelSection,
    PrecisionSection,
    TrainSection,
    model_config_of,
)
from megatrain.step import StepBatch
from megatrain_store.progress import progress  # noqa: E402
from megatrain_zoo import config_to_hf, flops_per_token, preset  # noqa: E402


class BenchTrainer(Trainer):
    def _init_weights(self):
        start = time.perf_counter()
        for group in progress(range(self.store.n_groups), desc="draw weights", unit="group"):
            with self.store.writing(group) as views:  # (a packed group: packed on exit)
                for name, view in views.items():
                    if name.endswith("norm.weight"):
                        view.fill_(1.0)
                    else:
                        fill_random_(view.view(-1), self.model_config.initializer_range)
        self.init_weights_s = time.perf_counter() - start  # (of setup_s: a packed base is quantized here)


def random_batch(n_seqs, seq_len, vocab, doc_len=0):
    """(input_ids, labels, position_ids): random tokens; with doc_len, each row packs documents of
    doc_len tokens (positions restart, no label crosses a boundary), else position_ids is None."""
    ids = torch.randint(0, vocab, (n_seqs, seq_len))
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    if not doc_len:
        return ids, labels, None
    positions = (torch.arange(seq_len) % doc_len).expand(n_seqs, -1).contiguous()
    labels[:, :-1][positions[:, 1:] == 0] = -100
    return ids, labels, positions


def host_triad_gbps(numel: int = 1 << 27) -> float:
    """The host's memory bandwidth as STREAM's triad measures it (a = b + s * c over three buffers of `numel` fp32,
    pinned where there is a GPU, as the store's arenas are; bytes read and written a second, the best of 5), with
    torch's threads: the physical limit of the CPU's AdamW, which moves ADAMW_BYTES_PER_PARAM a parameter."""
    pinned = torch.cuda.is_available()
    a, b, c = (torch.ones(numel, pin_memory=pinned) for _ in range(3))
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        best = min(best, time.perf_counter() - start)
    return round(3 * 4 * numel / best / 1e9, 1)


def _optimizer_fields(trainer, split: dict, triad_gbps: float) -> dict:
    """The CPU AdamW's bytes a second in the timed steps, beside the host's triad bandwidth, and its threads."""
    store = trainer.store
    on_gpu = set(trainer.device_optimizer.groups) if trainer.device_optimizer is not None else set()
    cpu_params = sum(store.layouts[g].numel for g in range(store.n_groups) if g not in store.frozen | on_gpu)
    seconds = split.get("optimizer", 0.0)
    gbps = round(cpu_params * ADAMW_BYTES_PER_PARAM / seconds / 1e9, 1) if seconds else None
    return {
        "cpu_updated_params_b": round(cpu_params / 1e9, 3),
        "optimizer_gbps": gbps,
        "host_triad_gbps": triad_gbps,
        "cpu_threads": torch.get_num_threads(),
    }


def span_totals(timeline, t_start_us, t_end_us) -> dict:
    """Busy time per track inside [start, end] (union of spans, so overlaps count once); `step_start`: the host's
    beginning of each sweep (its placement fitted, its batches copied, its first weights queued)."""
    busy = {}
    for track in ("copy_in", "compute", "copy_out", "optimizer", "step_start"):
        spans = sorted(
            (max(s["start_us"], t_start_us), min(s["end_us"], t_end_us)) for s in timeline.spans if s["track"] == track
        )
        total, cursor = 0.0, t_start_us
        for start, end in spans:
            start = max(start, cursor)
            if end > start:
                total += end - start
                cursor = end
        busy[track] = total / 1e6
    return busy


def bench_megatrain(name, args, implementation="native"):
    """megatrain's rows for one model: a trainer set up for the largest point, each point's first step placing
    the engine for its own size."""
    token_counts = _token_counts(args)
    config, model = _megatrain_config(name, args, implementation)
    triad_gbps = host_triad_gbps()  # (before the store takes the host's memory)
    t0 = time.perf_counter()
    trainer = BenchTrainer(config, model)
    trainer.timeline.keep_steps = None  # the timed steps' spans are all summed below
    setup_s = time.perf_counter() - t0
    next_batch = _batches(config, model, args.real_text, args.doc_len)
    rows = []
    for tokens in token_counts:
        timing = _time_point(trainer, next_batch, tokens // args.seq_len, args.steps, args.warmup)
        if args.trace_dir and tokens == max(token_counts):
            trainer.timeline.write_chrome_trace(Path(args.trace_dir) / f"trace-{name}-{tokens}.json")
        n_seqs = tokens // args.seq_len
        flops = flops_per_token(model, args.doc_len or args.seq_len, trainer.spec.active_adapter_params)
        rows.append(
            base_row("megatrain", name, model, args.seq_len, n_seqs, args.micro_batch, timing["step_s"])
            | placement_fields(trainer, timing["step_s"])
            | _host_fields(trainer.store.memory_report(), trainer.plan)
            | _optimizer_fields(trainer, timing["split"], triad_gbps)
            | {
                "grad_clip": args.grad_clip,
                "doc_len": args.doc_len,  # 0: one sequence per row
                # attention FLOPs of what is computed: within documents when packed
                "model_tflops": round(flops * tokens / timing["step_s"] / 1e12, 1),
                "flop_convention": FLOP_CONVENTIONS[trainer.spec.adapter is not None],
                "adapter": _adapter_label(config),
                "wire_copy": config.engine.wire_copy,
                "n_slots": args.n_slots,
                "n_layers": model.n_layers,
                "setup_s": round(setup_s, 1),  # the compile warm-up included
                "init_weights_s": round(trainer.init_weights_s, 1),  # of setup_s: drawing (and packing) the weights
                "compile_warm_up_s": round(trainer.warm_up_s, 1),
                "warmup_steps_s": round(timing["warmup_s"], 1),
                "timing": STEADY_STATE,
                "time_split_s_per_step": timing["split"],
                "host_stalls_per_step": timing["stalls"],  # allocator retries, device-wide waits, collections
                "losses": [round(x, 4) for x in timing["losses"]],
                # above grad_clip, the step's updates were scaled: the host's fused AdamW then also writes each
                # scaled gradient back (4 bytes a parameter more than the 28 it moves otherwise)
                "grad_norms": [round(x, 4) for x in timing["grad_norms"]],
                "implementation": implementation,  # native: megatrain's templates; transformers: its own modules
            }
        )
        print(rows[-1], flush=True)
    trainer.close()
    del trainer
    gc.collect()
    return rows


# what a row's model TFLOPS count: full training's 6 FLOPs a parameter and token; LoRA's 4 a frozen base parameter
# (forward, and the input's gradient: no weight gradient) and 6 an adapter parameter; attention on top of each
FLOP_CONVENTIONS = {False: "6PT + attention", True: "4PT (frozen base) + 6 x adapter params x T + attention"}


def _adapter_label(config) -> str | None:
    adapter = config.model.adapter
    if adapter.type is None:
        return None
    base = f" over {adapter.base_dtype}" if adapter.base_dtype in ("nf4", "int8") else ""
    return f"lora r={adapter.r} {','.join(adapter.target_modules)}{base}"


def _token_counts(args) -> list[int]:
    return [int(t) for t in args.tokens.split(",")]


def _megatrain_config(name, args, implementation):
    """(Config, ModelConfig) of a run set up for the largest point (`--layers`: the model's first layers)."""
    adapter = (
        AdapterSection("lora", args.lora_r, 2.0 * args.lora_r, base_dtype=args.lora_base)
        if args.lora_r
        else AdapterSection()
    )
    section = ModelSection(preset=name, implementation=implementation, adapter=adapter)
    model = model_config_of(Config(model=section))
    if args.layers:  # the first layers of a model whose whole does not fit the host: its layer shape, measured
        model = model.first_layers(args.layers)
    train = TrainSection(
        steps=10**6,
        batch_size=max(_token_counts(args)) // args.seq_len,
        micro_batch_size=args.micro_batch,
        grad_clip=args.grad_clip,
        lr=args.lr,
        warmup_steps=0,
        schedule="constant",
    )
    config = Config(
        model=section,
        data=DataSection(seq_len=args.seq_len),
        train=train,
        precision=PrecisionSection("bfloat16"),
        engine=EngineSection(n_slots=args.n_slots, trace=True, **engine_options(args)),
        device="cuda",
        output_dir=tempfile.mkdtemp(),
    )
    return config, model


def _batches(config, model, real_text, doc_len):
    """next_batch(n_seqs) -> (input_ids, labels, position_ids): random tokens (packed documents of `doc_len`), or
    with `real_text` the shipped corpus under a BPE tokenizer trained on it (losses that mean something)."""
    seq_len = config.data.seq_len
    if not real_text:
        return lambda n_seqs: random_batch(n_seqs, seq_len, model.vocab_size, doc_len)
    from megatrain_data import TokenWindows, load_token_array

    tokens, _ = load_token_array(config.data, min(8192, model.vocab_size), Path(config.output_dir), None)
    windows, served = {}, itertools.count(1)

    def next_batch(n_seqs):
        windows.setdefault(n_seqs, TokenWindows(tokens, seq_len, n_seqs, shuffle=True, seed=0))
        batch = windows[n_seqs].batch(next(served))
        return batch.input_ids, batch.labels, None

    return next_batch


def _time_point(trainer, next_batch, n_seqs, steps, warmup) -> dict:
    """Warm-up steps, then `steps` timed ones in the steady state (`common.steady_steps`): seconds a step, the
    warm-up's seconds, the losses, and each track's busy seconds a step (with the compute stream's idle)."""
    torch.cuda.reset_peak_memory_stats()
    trainer.timeline.spans.clear()  # (the trace written after: this point's warm-up and timed steps)
    timing = steady_steps(trainer, lambda: StepBatch(*next_batch(n_seqs)), steps, warmup)
    trainer.timeline.resolve()
    origin = (timing["window_start"] - trainer.timeline._origin_host) * 1e6
    busy = span_totals(trainer.timeline, origin, origin + timing["step_s"] * steps * 1e6)
    timing["split"] = {k: round(v / steps, 3) for k, v in busy.items()} | {
        "gpu_compute_idle": round(timing["step_s"] - busy["compute"] / steps, 3)
    }
    return timing


def placement_fields(trainer, step_s) -> dict:
    """What the trainer placed this point's steps as (its first step did, where the size changed), and how the
    planner's prediction came out."""
    plan, executed = trainer.plan, trainer.pipeline.executed
    headroom = trainer.pipeline.device_headroom
    return {
        "predicted_step_s": round(plan.step_s, 3),
        "prediction_error": round(plan.step_s / step_s - 1, 3),
        "bound": plan.bound,
        "compute_bound_tokens": trainer.planner.compute_bound_tokens(),  # (the report's: a run's plan leaves it out)
        "rates": plan.rates.source,
        # the rates' values, so that a plan of a larger model can rest on the ones measured here
        "planning_rates": {name: value for name, value in asdict(plan.rates).items() if name != "source"},
        # the placement the steps ran, and whether it is the planner's as planned (no fallback)
        "placement": executed.as_dict(),
        "placement_as_planned": executed == trainer.placement and trainer.pipeline.fallback is None,
        "fallback": trainer.pipeline.fallback,
        # device memory the planner left free beside what the step counts on (GiB; negative: short)
        "device_headroom_gib": None if headroom is None else round(headroom / 2**30, 2),
        "gradient_pool": trainer.store.grad_pool,  # in largest groups (None: a buffer per group)
        "kept_layers": len(executed.keeping),  # their matmul products kept: no GEMM recomputed
        "host_kept_layers": len(executed.host_kept),  # of those, kept in pinned host memory
        # of those, keeping their extra products too out of the headroom (their attention kernel's results)
        "extra_kept_layers": len(trainer.pipeline.extras),
        "offloaded_layers": len(executed.offloaded),  # activation checkpoints in host memory
        "held_layers": len(executed.held),  # weights on the GPU from forward to backward
        "sweeps": executed.sweeps,  # forward-backward sweeps a step ran in
        # blocks whose masters and moments live on the GPU, updated there (with the untied embedding)
        "gpu_updated_layers": plan.gpu_updated_layers,
        "copied_layers": len(executed.copied),  # of those, bound to their compute-dtype copy (never cast)
        "parked_layers": len(executed.parked),  # stages whose moments wait in host memory from update to backward
        "expert_parts": len(trainer.spec.expert_parts),  # 0: each MoE layer is one stage
    }


def _host_fields(report, plan) -> dict:
    """The host memory the run took (the store's report, and the process's peak) beside what it planned (its
    allocations, with what the process held when planned)."""
    return {
        "planned_host_gib": round((plan.host_bytes + plan.process_bytes) / 2**30, 1),
        "planned_host_items_gib": {name: round(size / 2**30, 2) for name, size in plan.host_items.items()},
        "host_budget": plan.host_source,
        "host_gib": round(report.total_bytes / 2**30, 1),
        "host_bytes_per_param": round(report.bytes_per_param, 2),
        "pinned_gib": round(report.pinned_bytes / 2**30, 1),
        "pin_seconds": round(report.pin_seconds, 2),
        "disk_gib": round(sum((report.disk or {}).values()) / 2**30, 1),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 1),
    }


def bench_plain_pytorch(name, seq_len, token_counts, micro_seqs, steps, warmup, grad_clip=0.0):
    """Plain PyTorch at the largest micro-batch (halving from `micro_seqs`) that fits in GPU memory, clipping at
    `grad_clip` (0: not) as megatrain's rows do."""
    while True:
        rows = _plain_pytorch(name, seq_len, token_counts, micro_seqs, steps, warmup, grad_clip)
        if rows[-1].get("fits", True) or micro_seqs == 1:
            return rows
        print(f"plain PyTorch: {name} does not fit with micro-batch {micro_seqs}; trying {micro_seqs // 2}", flush=True)
        micro_seqs //= 2


def _plain_pytorch(name, seq_len, token_counts, micro_seqs, steps, warmup, grad_clip):
    """The same model fully on the GPU: transformers' implementation, fp32 master weights, bf16 autocast,
    per-layer activation checkpointing, fused AdamW. Returns rows, or one row saying it does not fit."""
    rows = []
    model = None
    try:
        model, optimizer = _plain_model(name)
        config = preset(name)
        for tokens in token_counts:
            n_seqs = tokens // seq_len
            step = functools.partial(
                _plain_step, model, optimizer, config.vocab_size, seq_len, n_seqs, micro_seqs, grad_clip
            )
            step_s = _time_plain_steps(step, steps, warmup)
            rows.append(base_row("pytorch-gpu", name, config, seq_len, n_seqs, micro_seqs, step_s))
            rows[-1]["grad_clip"] = grad_clip
            print(rows[-1], flush=True)
    except torch.cuda.OutOfMemoryError as error:
        rows.append(
            {
                "system": "pytorch-gpu",
                "model": name,
                "micro_batch_seqs": micro_seqs,
                "fits": False,
                "error": str(error).splitlines()[0][:200],
            }
        )
        print(rows[-1], flush=True)
    finally:
        model = None
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def _plain_model(name):
    """(model, optimizer): transformers' implementation of preset `name` on the GPU in fp32, with per-layer
    activation checkpointing, and fused AdamW over its parameters."""
    import transformers

    hf_config = transformers.AutoConfig.for_model(**config_to_hf(preset(name)))
    hf_config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(hf_config, torch_dtype=torch.float32).cuda()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    return model, optimizer


def _time_plain_steps(step, steps, warmup) -> float:
    """Warm-up calls of `step`, then `steps` timed ones: seconds a step."""
    torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup):
        step()
    return timed(step, steps)


def _plain_step(model, optimizer, vocab_size, seq_len, n_seqs, micro_seqs, grad_clip) -> float:
    """One AdamW step on `n_seqs` random sequences, in micro-batches of `micro_seqs` under bf16 autocast, the
    gradients clipped to norm `grad_clip` (0: not): the loss."""
    optimizer.zero_grad(set_to_none=True)
    ids, labels, _ = random_batch(n_seqs, seq_len, vocab_size)
    loss_total = 0.0
    for mb_ids, mb_labels in zip(ids.split(micro_seqs), labels.split(micro_seqs)):
        mb_ids, mb_labels = mb_ids.cuda(), mb_labels.cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=mb_ids).logits
        loss = torch.nn.functional.cross_entropy(
            logits.float().view(-1, logits.shape[-1]), mb_labels.view(-1), ignore_index=-100
        ) * (mb_ids.shape[0] / n_seqs)
        loss.backward()
        loss_total += loss.detach()
    if grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return float(loss_total)


def engine_options(args) -> dict:
    """The engine settings of the command line, as EngineSection takes them ("auto", or a number)."""

    def auto_or(value, kind):
        return value if value == "auto" else kind(value)

    return {
        "optimizer_state_dir": args.optimizer_state_dir,
        "disk_state_fraction": auto_or(args.disk_state_fraction, float),
        "wire_copy": args.wire_copy,
        "experts_per_stage": auto_or(args.experts_per_stage, int),
        "kept_layers": auto_or(args.kept_layers, int),
        "host_kept_layers": auto_or(args.host_kept_layers, int),
        "offload_checkpoints": auto_or(args.offload_checkpoints, lambda value: value == "true"),
        "held_layers": auto_or(args.held_layers, int),
        "gpu_updated_layers": auto_or(args.gpu_updated_layers, int),
        "copied_layers": auto_or(args.copied_layers, int),
        "parked_layers": auto_or(args.parked_layers, int),
        "gradient_pool": auto_or(args.gradient_pool, float),
        "sweeps": auto_or(args.sweeps, int),
    }


def _add_engine_arguments(parser) -> None:
    """The engine settings (`engine_options`), each "auto" unless set."""
    parser.add_argument("--optimizer-state-dir", default=None, help="the disk tier: AdamW moments in files here")
    parser.add_argument(
        "--disk-state-fraction", default="auto", help="share of the moments on disk (auto: what does not fit)"
    )
    parser.add_argument("--wire-copy", action="store_true", help="keep a bf16 copy of the weights in host memory")
    parser.add_argument(
        "--experts-per-stage", default="auto", help="MoE: stream a layer's experts in parts of this many"
    )
    parser.add_argument(
        "--kept-layers",
        default="auto",
        help="layers that keep their matmul products (auto: what fits the GPU; 0: none)",
    )
    parser.add_argument(
        "--host-kept-layers", default="auto", help="more layers keeping their products in pinned host memory (0: none)"
    )
    parser.add_argument(
        "--offload-checkpoints", default="auto", choices=["auto", "true", "false"], help="checkpoints to host memory"
    )
    parser.add_argument(
        "--held-layers", default="auto", help="layers whose weights stay on the GPU from forward to backward"
    )
    parser.add_argument(
        "--gpu-updated-layers", default="auto", help="first layers whose masters and moments live on the GPU"
    )
    parser.add_argument(
        "--copied-layers", default="auto", help="of those, the first whose compute-dtype copy stays there too"
    )
    parser.add_argument(
        "--parked-layers",
        default="auto",
        help="GPU-updated stages (the first) whose moments wait in host memory from their update to the backward",
    )
    parser.add_argument(
        "--gradient-pool", default="auto", help="gradient landing pool in largest groups (auto: as planned)"
    )
    parser.add_argument("--sweeps", default="auto", help="forward-backward sweeps a step runs in (auto: as planned)")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="llama3.2-1b,llama3.2-3b,qwen2.5-7b")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--tokens", default="32768,65536", help="tokens per optimizer step, comma-separated")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per forward/backward pass")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per point")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--grad-clip",
        type=float,
        default=1.0,
        help="as users run (default 1.0); 0: updates as gradients land (12 B/param)",
    )
    parser.add_argument("--n-slots", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--real-text", action="store_true", help="train on the shipped corpus instead of random tokens")
    parser.add_argument(
        "--baseline",
        default="auto",
        choices=["auto", "none"],
        help="auto: plain PyTorch for models under --baseline-max-b billion params",
    )
    parser.add_argument("--baseline-max-b", type=float, default=4.0)
    parser.add_argument("--trace-dir", default=None, help="write a Chrome trace of each model's largest point here")
    parser.add_argument(
        "--doc-len", type=int, default=0, help="pack documents of this many tokens per row (per-document attention)"
    )
    parser.add_argument("--layers", type=int, default=0, help="keep only the first N layers of each model")
    parser.add_argument(
        "--lora-r",
        type=int,
        default=0,
        help="train LoRA adapters of this rank (alpha 2r) on every linear layer over "
        "the frozen model (0: full training)",
    )
    parser.add_argument(
        "--lora-base", choices=["nf4", "int8"], default=None, help="hold LoRA's frozen base packed (QLoRA): nf4 or int8"
    )
    parser.add_argument(
        "--implementation",
        default="native",
        help="comma-separated: native (megatrain's templates), transformers (the family's own modules)",
    )
    parser.add_argument("--out", default="benchmarks/results/throughput.json")
    _add_engine_arguments(parser)
    return parser.parse_args()


def main():
    args = parse_args()
    results = []
    payload = {"benchmark": "throughput", "machine": machine(), "args": vars(args), "results": results}
    for name, implementation in itertools.product(args.models.split(","), args.implementation.split(",")):
        results += bench_megatrain(name, args, implementation)
        if args.layers:  # what the tables call a part of a model
            for row in results:
                row.setdefault("scope", f"first {args.layers} layers")
        write_results(Path(args.out), payload)
        if args.baseline == "auto" and preset(name).n_params / 1e9 <= args.baseline_max_b:
            token_counts = _token_counts(args)
            results += bench_plain_pytorch(
                name, args.seq_len, token_counts, args.micro_batch, args.steps, args.warmup, args.grad_clip
            )
            write_results(Path(args.out), payload)
    columns = ["system", "model", "tokens_per_step", "step_time_s", "tokens_per_s", "model_tflops", "peak_gpu_gib"]
    print(table(results, [*columns, "host_bytes_per_param"]))


if __name__ == "__main__":
    main()
