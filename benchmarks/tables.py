"""The docs' result tables, generated from the rows of benchmarks/results (one schema: results_schema.py).
Each table answers one question from the newest rows that answer it, and lists under it the commands,
machines and dates of those rows. It lives in a doc between `<!-- table: NAME -->` and `<!-- end table -->`.
The README keeps its tables short: under each, a link to the same table in docs/benchmarks.md, which lists them.

    python benchmarks/tables.py          # rewrite every generated table in README.md and docs/*.md
    python benchmarks/tables.py --check  # exit 1 naming each doc whose tables are stale
"""

import argparse
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from results_schema import MOE_LAYER, MOE_LAYER_KEPT, load_rows  # noqa: E402

ROOT = Path(__file__).parent.parent
DOCS = [ROOT / "README.md", ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "scaling.md"]
README = ROOT / "README.md"
# where the README's tables are repeated with their commands (a section of docs/benchmarks.md holding the same regions)
README_SOURCES = "docs/benchmarks.md#the-readmes-headline-numbers"
REGION = re.compile(r"(<!-- table: (?P<name>[a-z][a-z0-9.-]*) -->\n)(?P<body>.*?)(<!-- end table -->)", re.S)


@dataclass
class Table:
    """A generated table: its header, its body cells, and the result rows it was made from."""

    header: list[str]
    body: list[list[str]]
    sources: list[dict]
    align: str = ""  # one letter per column, l or r (default: the first left, the rest right)


# Selecting rows


def device(row: dict) -> str:
    """The GPU a row ran on: its own machine's where it names one, else its file's."""
    return (row.get("machine") or {}).get("device") or row["file_machine"]["device"]


def gpu(row: dict) -> str:
    """A short name of the row's GPU (H100, H200, ...)."""
    match = re.search(r"(H100|H200|A100|B200)", device(row))
    return match.group(1) if match else device(row)


def is_default(row: dict) -> bool:
    """Whether the row ran the engine as it was by default then (rows of other settings carry an `engine` label)."""
    return not row.get("engine") or row["engine"].startswith("default")


def steps(rows: list[dict], system: str = "megatrain", parts: bool = False, **match) -> list[dict]:
    """Measured training steps of the default engine whose fields match: of whole models, and with `parts` also of
    a model's first layers."""
    chosen = []
    for row in rows:
        scope = row.get("scope", "")
        if row["system"] != system or row.get("fits") is False or not row.get("step_time_s") or not is_default(row):
            continue
        if scope and not (parts and scope.startswith("first")):
            continue
        if all(row.get(key) == value for key, value in match.items()):
            chosen.append(row)
    return chosen


def clipping_cell(clip: float | None) -> str:
    """A table's clipping cell: "at 1.0", or "none"."""
    return f"at {clip}" if clip else "none"


def clipping_words(clip: float | None) -> str:
    """A headline's words for a run's clipping: "clipping at 1.0", or "no clipping"."""
    return f"clipping at {clip}" if clip else "no clipping"


SAME_CALL_MINUTES = 15  # rows measured this close together ran in one device call, on one machine


def same_call(a: dict, b: dict) -> bool:
    """Whether two rows were measured in one device call (within `SAME_CALL_MINUTES`): two calls may run on
    different machines, whose hosts' CPU AdamW differ by a third."""
    minutes = [
        datetime.strptime(r["date"], "%Y-%m-%d %H:%M").timestamp() / 60 if " " in r["date"] else math.nan
        for r in (a, b)
    ]
    return abs(minutes[0] - minutes[1]) <= SAME_CALL_MINUTES


def newest(rows: list[dict], key: Callable[[dict], object]) -> dict:
    """For each key, the row measured last (by date, then by its place in the files)."""
    best: dict = {}
    for row in rows:
        k = key(row)
        if k not in best or (row["date"], row["order"]) >= (best[k]["date"], best[k]["order"]):
            best[k] = row
    return best


def part(row: dict) -> str:
    """What of the model a row timed: the whole model, or the scope it names; and how, where it trained adapters
    alone."""
    scope, adapter = row.get("scope", "whole model"), row.get("adapter")
    if not adapter:
        return scope
    return training(row) if scope == "whole model" else f"{scope}, {training(row)}"


def training(row: dict) -> str:
    """How a row trained: every parameter, or LoRA adapters over a frozen base."""
    adapter = row.get("adapter")
    if not adapter:
        return "full"
    words = adapter.split(" ")  # ("lora r=16 all-linear": LoRA r=16; "lora r=16 all-linear over nf4": ... over nf4)
    return " ".join(["LoRA", words[1], *words[3:]])


# Formatting


def num(value, digits: int | None = None) -> str:
    """A number as the docs show it: thousands separated, `digits` decimals if given, '-' when absent."""
    if value is None:
        return "-"
    return f"{value:,}" if digits is None else f"{value:,.{digits}f}"


def seconds(value) -> str:
    """A time in seconds as written in its file (a planner's unrounded one to the millisecond)."""
    return "-" if value is None else f"{round(value, 3)} s"


def tokens(value) -> str:
    """Tokens per step as 16k, 128k, ..."""
    return "-" if value is None else f"{value // 1024}k" if value % 1024 == 0 else f"{value:,}"


def ratio(ours, theirs) -> str:
    return "-" if not ours or not theirs else f"**{ours / theirs:.2f}x**"


def error(predicted, measured) -> str:
    return "-" if predicted is None or not measured else f"{predicted / measured - 1:+.1%}"


# The tables


def dense_7b_by_step_size(rows: list[dict]) -> Table:
    """Qwen2.5-7B (sequences of 4096) on one H100, the newest default-engine row per step size."""
    h100 = [r for r in steps(rows, model="qwen2.5-7b", seq_len=4096) if gpu(r) == "H100"]
    best = newest([r for r in h100 if r["tokens_per_step"] in (16384, 32768, 131072)], lambda r: r["tokens_per_step"])
    chosen = [best[t] for t in sorted(best)]
    header = [
        "tokens/step",
        "step",
        "tokens/s",
        "model TFLOPS",
        "planned step",
        "kept layers",
        "GPU-updated layers",
        "date",
    ]
    body = [
        [
            tokens(r["tokens_per_step"]),
            seconds(r["step_time_s"]),
            num(r["tokens_per_s"]),
            f"**{r['model_tflops']}**",
            seconds(r.get("predicted_step_s")),
            num(r.get("kept_layers")),
            num(r.get("gpu_updated_layers")),
            r["date"],
        ]
        for r in chosen
    ]
    return Table(header, body, chosen)


def dense_7b_as_users_run(rows: list[dict]) -> Table:
    """Qwen2.5-7B on one H200 with clipping at 1.0 (what users run), the newest no-clip step of the file beside it
    where the file has one, and what clipping costs where the two ran in one call:
    `benchmarks/results/clipping-qwen2.5-7b-h200.json`."""
    runs = [r for r in steps(rows, model="qwen2.5-7b") if r["file"] == "clipping-qwen2.5-7b-h200.json"]
    chosen = newest(runs, lambda r: (r["tokens_per_step"], bool(r.get("grad_clip")))).values()
    clipped = sorted((r for r in chosen if r.get("grad_clip")), key=lambda r: r["tokens_per_step"])
    unclipped = {r["tokens_per_step"]: r for r in chosen if not r.get("grad_clip")}
    header = [
        "tokens/step",
        "step",
        "model TFLOPS",
        "no clipping",
        "clipping costs",
        "planned step",
        "GPU-updated",
        "GPU idle",
        "host AdamW / host triad",
        "timed",
    ]
    body = []
    for r in clipped:
        free = unclipped.get(r["tokens_per_step"])
        body.append(
            [
                tokens(r["tokens_per_step"]),
                seconds(r["step_time_s"]),
                f"**{r['model_tflops']}**",
                "-" if free is None else f"{free['model_tflops']} ({seconds(free['step_time_s'])})",
                f"{100 * (r['step_time_s'] / free['step_time_s'] - 1):+.1f}%" if free and same_call(r, free) else "-",
                seconds(r.get("predicted_step_s")),
                num(r.get("gpu_updated_layers")),
                seconds(r["time_split_s_per_step"]["gpu_compute_idle"]),
                f"{r['optimizer_gbps']} / {r['host_triad_gbps']} GB/s" if r.get("optimizer_gbps") else "-",
                "steady state" if r.get("timing") else "with the last step's updates",
            ]
        )
    return Table(header, body, clipped + list(unclipped.values()))


def lora_against_full(rows: list[dict]) -> Table:
    """LoRA over a frozen Qwen2.5-7B on one H200 against full training at the same size and clipping: the newest
    default LoRA rows (`lora-qwen2.5-7b-h200.json`) beside the full rows of `dense_7b_as_users_run`."""
    lora = [r for r in steps(rows, model="qwen2.5-7b") if r["file"] == "lora-qwen2.5-7b-h200.json"]
    full = {r["tokens_per_step"]: r for r in dense_7b_as_users_run(rows).sources if r.get("grad_clip")}
    chosen = sorted((r for r in lora if r["tokens_per_step"] in full), key=lambda r: r["tokens_per_step"])
    header = ["tokens/step", "LoRA step", "full step", "LoRA / full", "LoRA model TFLOPS", "planned", "host GiB"]
    body = [
        [
            tokens(r["tokens_per_step"]),
            seconds(r["step_time_s"]),
            seconds(full[r["tokens_per_step"]]["step_time_s"]),
            f"**{100 * r['step_time_s'] / full[r['tokens_per_step']]['step_time_s']:.0f}%**",
            num(r["model_tflops"]),
            seconds(r.get("predicted_step_s")),
            num(r.get("peak_rss_gib")),
        ]
        for r in chosen
    ]
    return Table(header, body, chosen + [full[r["tokens_per_step"]] for r in chosen])


def dense_7b_time_split(rows: list[dict]) -> Table:
    """Where a Qwen2.5-7B step's time goes, per step size: the newest default rows that recorded the split."""
    traced = [
        r for r in steps(rows, model="qwen2.5-7b", seq_len=4096) if gpu(r) == "H100" and "time_split_s_per_step" in r
    ]
    best = newest(traced, lambda r: r["tokens_per_step"])
    chosen = [best[t] for t in sorted(best) if t >= 16384]
    header = [
        "tokens/step",
        "step",
        "GPU compute busy",
        "weights in",
        "gradients out",
        "CPU AdamW",
        "GPU idle",
        "planner's bound",
    ]
    body = []
    for r in chosen:
        split = r["time_split_s_per_step"]
        body.append(
            [tokens(r["tokens_per_step"]), seconds(r["step_time_s"])]
            + [seconds(split[k]) for k in ("compute", "copy_in", "copy_out", "optimizer", "gpu_compute_idle")]
            + [r.get("bound", "-")]
        )
    return Table(header, body, chosen)


# (model, GPU, tokens a step, sequence length, clipping): every system of a row clips alike
COMPARED = [
    ("qwen2.5-3b", "H200", 32768, 1024, 1.0),
    ("qwen2.5-3b", "H200", 131072, 1024, 1.0),
    ("qwen2.5-3b", "H100", 32768, 2048, 0.0),
    ("qwen2.5-3b", "H100", 131072, 2048, 0.0),
    ("llama2-7b", "H200", 32768, 2048, 0.0),
    ("llama2-7b", "H200", 131072, 2048, 0.0),
]
DEEPSPEED_BEST_MICRO_BATCH_TOKENS = 32768  # 16 sequences of 2048, 32 of 1024: its best (benchmarks.md)


def compared_runs(rows: list[dict]) -> list[list[dict | None]]:
    """For each entry of COMPARED, the newest run of megatrain, DeepSpeed ZeRO-3 offload (at its best micro-batch) and
    plain PyTorch on the GPU (None where there is none), all clipping alike (a row without `grad_clip` did not clip:
    DeepSpeed's config then said 0)."""
    found = []
    for model, kind, tokens_per_step, seq_len, clip in COMPARED:
        found.append([])
        for system in ("megatrain", "deepspeed-zero3-offload", "pytorch-gpu"):
            candidates = [
                r
                for r in steps(rows, system, model=model, tokens_per_step=tokens_per_step, seq_len=seq_len)
                if gpu(r) == kind
                and (r.get("grad_clip") or 0.0) == clip
                and (
                    system != "deepspeed-zero3-offload"
                    or r["micro_batch_seqs"] * seq_len == DEEPSPEED_BEST_MICRO_BATCH_TOKENS
                )
            ]
            found[-1].append(newest(candidates, lambda r: 0).get(0))
    return found


def against_deepspeed(rows: list[dict], found: list[list[dict | None]] | None = None) -> Table:
    """megatrain against DeepSpeed ZeRO-3 offload and plain PyTorch on the GPU (`compared_runs`, or `found`)."""
    header = [
        "model",
        "GPU",
        "tokens/step",
        "clipping",
        "megatrain",
        "DeepSpeed ZeRO-3 offload",
        "plain PyTorch on the GPU",
        "megatrain / DeepSpeed",
        "megatrain / PyTorch",
    ]
    body, sources = [], []
    for (model, kind, tokens_per_step, _, clip), runs in zip(COMPARED, found or compared_runs(rows)):
        ours, deepspeed, pytorch = runs
        cells = [f"{r['model_tflops']} ({seconds(r['step_time_s'])})" if r else "-" for r in runs]
        cells[0] = f"**{cells[0]}**"
        body.append(
            [model, kind, tokens(tokens_per_step), clipping_cell(clip)]
            + cells
            + [
                ratio(ours and ours["model_tflops"], deepspeed and deepspeed["model_tflops"]),
                ratio(ours and ours["model_tflops"], pytorch and pytorch["model_tflops"]),
            ]
        )
        sources += [r for r in runs if r]
    return Table(header, body, sources, align="llrl" + "r" * 5)


def against_published(rows: list[dict]) -> Table:
    """megatrain's newest Qwen2.5-7B row on an H100 against what the published layer-streaming system reports."""
    published = [r for r in rows if r["system"] == "published-layer-streaming"]
    ours = newest(
        [r for r in steps(rows, model="qwen2.5-7b", seq_len=4096, tokens_per_step=131072) if gpu(r) == "H100"],
        lambda r: 0,
    )[0]
    body = [
        [
            r["model"],
            "H100",
            f"**{ours['model_tflops']}** ({tokens(ours['tokens_per_step'])} tokens/step)",
            f"{r['model_tflops']} (as published)",
            ratio(ours["model_tflops"], r["model_tflops"]),
        ]
        for r in published
    ]
    return Table(
        ["model", "GPU", "megatrain model TFLOPS", "published layer-streaming system", "ratio"],
        body,
        [ours] + published,
        align="llrrr",
    )


def does_not_fit(rows: list[dict]) -> Table:
    """What a baseline could not train, and how it failed."""
    failed = [r for r in rows if r.get("fits") is False and r["system"] != "megatrain" and "scope" not in r]
    body = [
        [r["system"], r["model"], gpu(r), f"{r['file_machine']['host_memory_gib']} GiB", r["error"]] for r in failed
    ]
    return Table(["system", "model", "GPU", "host memory", "what happened"], body, failed, align="lllrl")


FAMILIES = [
    "gemma-3-1b",
    "gemma-3-4b",
    "gemma-2-2b",
    "phi-3-mini-4k",
    "olmo-2-1b",
    "qwen3-8b",
    "llama-4-scout-17b-16e",
    "qwen3.5-0.8b",
    "qwen3.5-27b",
]


def families(rows: list[dict]) -> Table:
    """Each dense family on one H100 (first layers where the whole model does not fit the host), transformers beside."""
    ours = newest(
        [r for r in steps(rows, parts=True) if r["model"] in FAMILIES and gpu(r) == "H100"],
        lambda r: (r["model"], part(r), r["tokens_per_step"]),
    )
    theirs = newest(
        [r for r in steps(rows, "pytorch-gpu") if r["model"] in FAMILIES], lambda r: (r["model"], r["tokens_per_step"])
    )
    chosen = sorted(ours.values(), key=lambda r: (FAMILIES.index(r["model"]), r["tokens_per_step"]))
    header = ["model", "part", "tokens/step", "step", "tokens/s", "model TFLOPS", "transformers on the GPU", "date"]
    body, sources = [], list(chosen)
    for r in chosen:
        baseline = theirs.get((r["model"], r["tokens_per_step"])) if "scope" not in r else None
        sources += [baseline] if baseline else []
        cell = f"{baseline['model_tflops']} (micro-batch {baseline['micro_batch_seqs']})" if baseline else "-"
        body.append(
            [
                r["model"],
                part(r),
                tokens(r["tokens_per_step"]),
                seconds(r["step_time_s"]),
                num(r["tokens_per_s"]),
                f"**{r['model_tflops']}**",
                cell,
                r["date"],
            ]
        )
    return Table(header, body, sources, align="ll" + "r" * 6)


def block_ceilings(rows: list[dict]) -> Table:
    """One decoder block's forward and recompute + backward (default SDPA backends): the per-layer ceiling."""
    blocks = [r for r in rows if r.get("scope", "").endswith("recompute+bwd, SDPA default") and is_default(r)]
    best = newest(blocks, lambda r: r["model"])
    chosen = sorted(best.values(), key=lambda r: r["model_tflops"])
    body = [
        [
            r["model"],
            f"{r['tokens_per_step'] // r['seq_len']} x {r['seq_len']}",
            f"{r['forward_ms']} ms",
            f"{r['recompute_backward_ms']} ms",
            f"**{r['model_tflops']}**",
        ]
        for r in chosen
    ]
    header = ["block of", "sequences", "forward", "recompute + backward", "model-TFLOPS ceiling"]
    return Table(header, body, chosen, align="llrrr")


def linear_attention_parts(rows: list[dict]) -> Table:
    """One Gated DeltaNet layer's parts against a full-attention layer's SDPA, current engine."""
    parts = [r for r in rows if r["file"].startswith("qwen3.5") and r.get("tflops") is not None and is_default(r)]
    chosen = list(newest(parts, lambda r: (r["model"], r["scope"])).values())
    body = [[r["model"], r["scope"], gpu(r), f"{r['timed_ms']} ms", num(r["tflops"]), r["date"]] for r in chosen]
    header = ["model", "part (16k tokens, forward + backward)", "GPU", "time", "TFLOPS", "date"]
    return Table(header, body, chosen, align="llrrrr")


def preference_training(rows: list[dict]) -> Table:
    """DPO against SFT of the same tokens, and its reference pass: the newest default rows of `benchmarks/dpo.py`."""
    dpo = [r for r in rows if r["file"].startswith("dpo-") and is_default(r)]
    chosen = list(newest(dpo, lambda r: (r["model"], r["scope"])).values())
    body = [
        [
            r["model"],
            r["scope"],
            tokens(r["tokens_per_step"]),
            seconds(r["step_time_s"]),
            num(r["tokens_per_s"]),
            f"**{num(r['model_tflops'])}**" if r.get("model_tflops") else "-",
            f"{r.get('host_bytes_per_param', '-')}",
        ]
        for r in chosen
    ]
    header = ["model", "what", "tokens", "time", "tokens/s", "model TFLOPS", "host B/param"]
    return Table(header, body, chosen, align="llrrrrr")


def generic_template(rows: list[dict]) -> Table:
    """Any transformers decoder through its own modules against megatrain's native templates: the newest run of the
    generic path that has a native run of the same model, GPU, clipping and step size in its device call (measured
    within `SAME_CALL_MINUTES`: two calls run on different machines, whose hosts' CPU AdamW differ), beside it; or
    the newest alone."""

    def run(r: dict) -> tuple:
        return (r["model"], gpu(r), bool(r.get("grad_clip")), r["tokens_per_step"])

    natives = [r for r in steps(rows) if r.get("implementation", "native") == "native"]

    def partner(generic: dict) -> dict | None:
        """The newest native run of `generic`'s device call, if any."""
        same = [n for n in natives if run(n) == run(generic) and same_call(n, generic)]
        return newest(same, run).get(run(generic))

    generic = [r for r in rows if r.get("implementation", "native") != "native" and r.get("model_tflops")]
    chosen_generic = newest(generic, run) | newest([r for r in generic if partner(r)], run)
    body, chosen = [], []
    for r in sorted(chosen_generic.values(), key=run):
        ours = partner(r)
        for row in (ours, r) if ours else (r,):
            body.append(
                [
                    row["model"],
                    row.get("implementation", "native"),
                    gpu(row),
                    clipping_cell(row.get("grad_clip")),
                    tokens(row["tokens_per_step"]),
                    seconds(row["step_time_s"]),
                    f"**{num(row['model_tflops'])}**",
                    f"{row['model_tflops'] / ours['model_tflops']:.0%}" if ours and row is r else "-",
                    f"{row['kept_layers']} + {row['host_kept_layers']} host",
                ]
            )
            chosen.append(row)
    header = [
        "model",
        "layers",
        "GPU",
        "clipping",
        "tokens",
        "time",
        "model TFLOPS",
        "of native",
        "layers keeping products",
    ]
    return Table(header, body, chosen, align="llllrrrrr")


def grpo_toy(rows: list[dict]) -> Table:
    """GRPO learning a toy task from random weights: the mean reward per window of steps, `benchmarks/grpo_toy.py`."""
    toy = [r for r in rows if r["file"].startswith("grpo-toy")]
    chosen = list(newest(toy, lambda r: (r["model"], r["scope"])).values())
    body = [
        [
            r["model"],
            r["scope"].removeprefix("GRPO toy task, "),
            f"**{r['reward_mean']}**",
            num(r["frac_reward_zero_std"]),
        ]
        for r in chosen
    ]
    return Table(["model", "steps", "mean reward", "groups with equal rewards"], body, chosen, align="llrr")


def grpo_speed(rows: list[dict]) -> Table:
    """GRPO on one GPU: generation with the weights resident or streamed, and the training step, with each phase's
    share of a step: the newest rows of `benchmarks/grpo.py` per GPU."""
    speed = [r for r in rows if r["file"].startswith("grpo-qwen")]
    chosen = list(newest(speed, lambda r: (r["model"], gpu(r), r["scope"])).values())
    chosen.sort(key=lambda r: (r["params_b"], gpu(r), r["scope"].startswith("GRPO"), r["scope"]))
    body = [
        [
            r["model"],
            gpu(r),
            r["scope"],
            num(r.get("generated_tokens") or r["tokens_per_step"]),
            seconds(r["step_time_s"]),
            f"**{num(r['tokens_per_s'])}**",
            num(r["model_tflops"]) if r.get("model_tflops") else "-",
            str(r.get("kv_batch", "-")),
            f"{r['share_of_grpo_step']:.0%}" if r.get("share_of_grpo_step") else "-",
        ]
        for r in chosen
    ]
    header = ["model", "GPU", "phase", "tokens", "time", "tokens/s", "model TFLOPS", "KV batch", "share of a step"]
    return Table(header, body, chosen, align="lllrrrrrr")


def image_text(rows: list[dict]) -> Table:
    """An image-text model trained whole on one GPU beside its text-only rate: the newest rows of
    `benchmarks/image_text.py`."""
    chosen = list(
        newest([r for r in rows if r["file"].startswith("image-text")], lambda r: (r["model"], r["scope"])).values()
    )
    chosen.sort(key=lambda r: (r["model"], r["scope"] == "text alone", r["scope"]))
    body = [
        [
            r["model"],
            r["scope"],
            num(r["tokens_per_step"]),
            seconds(r["step_time_s"]),
            f"**{num(r['tokens_per_s'])}**",
            num(r["model_tflops"]),
            r.get("note") or "-",
        ]
        for r in chosen
    ]
    header = ["model", "step", "tokens", "time", "tokens/s", "model TFLOPS", "vision input"]
    return Table(header, body, chosen, align="llrrrrl")


MOE_MODELS = [
    "olmoe-1b-7b",
    "qwen1.5-moe-a2.7b",
    "qwen3-30b-a3b",
    "moonlight-16b-a3b",
    "deepseek-v2-lite",
    "glm-4.5-air",
    "gpt-oss-120b",
]


def moe_steps(rows: list[dict]) -> Table:
    """Mixtures of experts, whole models or their first layers, newest default rows (experts whole); the micro-batch
    (sequences x tokens) shown, since the newest row of a GPU and step size may have run at another than its
    neighbours."""
    candidates = [r for r in steps(rows, parts=True) if r["model"] in MOE_MODELS and not r.get("expert_parts")]
    best = newest(candidates, lambda r: (r["model"], part(r), gpu(r), r["tokens_per_step"]))
    chosen = sorted(best.values(), key=lambda r: (MOE_MODELS.index(r["model"]), r["tokens_per_step"]))
    header = [
        "model",
        "part",
        "GPU",
        "tokens/step",
        "micro-batch",
        "step",
        "tokens/s",
        "model TFLOPS (active)",
        "planned step",
        "date",
    ]
    body = [
        [
            r["model"],
            part(r),
            gpu(r),
            tokens(r["tokens_per_step"]),
            f"{r['micro_batch_seqs']} x {r['seq_len']}",
            seconds(r["step_time_s"]),
            num(r["tokens_per_s"]),
            f"**{r['model_tflops']}**",
            seconds(r.get("predicted_step_s")),
            r["date"],
        ]
        for r in chosen
    ]
    return Table(header, body, chosen, align="lll" + "r" * 7)


def moe_expert_parts(rows: list[dict]) -> Table:
    """A MoE layer's experts whole or streamed in parts (engine.experts_per_stage), full training or LoRA."""
    files = ("moe-expert-parts-h100.json", "moe-parts-olmoe-32k-h100.json")
    chosen = [r for r in rows if r["file"] in files and is_default(r)]
    body = [
        [
            r["model"],
            part(r),
            "whole" if not r["expert_parts"] else f"{r['expert_parts']} parts",
            clipping_cell(r.get("grad_clip")),
            tokens(r["tokens_per_step"]),
            seconds(r["step_time_s"]),
            seconds(r["predicted_step_s"]),
            f"**{r['model_tflops']}**",
            f"{r['peak_gpu_gib']} GiB",
            seconds(r["time_split_s_per_step"]["compute"]),
        ]
        for r in chosen
    ]
    header = ["model", "part", "experts", "clipping", "tokens/step", "step", "planned", "model TFLOPS", "peak GPU"]
    return Table(header + ["GPU compute busy"], body, chosen, align="llll" + "r" * 6)


def moe_layers(rows: list[dict]) -> Table:
    """One MoE layer's forward and backward, recomputing or from kept products: the newest default row per model,
    layer, GPU, tokens and way (rows that name no layer timed the model's first MoE layer)."""
    layers = [r for r in rows if r.get("scope") in (MOE_LAYER, MOE_LAYER_KEPT) and is_default(r)]

    def key(r):
        return (r["model"], r.get("layer", -1), gpu(r), r["tokens_per_step"], r["scope"])

    chosen = sorted(newest(layers, key).values(), key=key)
    body = [
        [
            r["model"],
            str(r["layer"]) if "layer" in r else "first MoE",
            gpu(r),
            tokens(r["tokens_per_step"]),
            "kept" if r["scope"] == MOE_LAYER_KEPT else "recomputed",
            f"{r['forward_recompute_backward_ms']} ms" if "forward_recompute_backward_ms" in r else "-",
            f"**{r['hardware_tflops']}**",
            num(r.get("model_tflops")) if r.get("model_tflops") else "-",
        ]
        for r in chosen
    ]
    header = [
        "MoE layer of",
        "layer",
        "GPU",
        "tokens",
        "matmul products",
        "fwd + bwd",
        "hardware TFLOPS",
        "model TFLOPS",
    ]
    return Table(header, body, chosen, align="lllrlrrr")


def plan_rows(rows: list[dict], file: str) -> list[dict]:
    return [r for r in rows if r["file"] == file and r["system"] == "megatrain plan"]


def moe_plans(rows: list[dict]) -> Table:
    """The planner's step times for published MoE shapes on one H200."""
    chosen = plan_rows(rows, "moe-plans.json")
    body = [
        [
            r["model"],
            f"{r['params_b']}B ({r['active_params_b']}B)",
            f"{r['host_gib']:,} GiB",
            tokens(r["tokens_per_step"]),
            seconds(r["step_time_s"]),
            num(r["model_tflops"]),
            r["bound"],
            tokens(r["compute_bound_tokens"]),
        ]
        for r in chosen
    ]
    header = [
        "model",
        "params (active)",
        "host memory",
        "tokens/step",
        "planned step",
        "model TFLOPS",
        "bound",
        "compute-bound from",
    ]
    return Table(header, body, chosen, align="l" + "r" * 5 + "lr")


def load_balance(rows: list[dict]) -> Table:
    """The worst MoE layer's load violation and the loss by balancing rate, a small model pre-trained from scratch."""
    chosen = [r for r in rows if r["file"].startswith("load-balance")]
    body = [
        [
            str(r["router_bias_update_rate"]),
            str(r.get("router_seq_aux_loss_coef", 0)),
            str(len(r["per_step"])),
            f"**{r['max_violation_mean_last_fifth']}**",
            f"**{r['final_loss_mean_last_fifth']}**",
            str(r["bias_spread"]),
        ]
        for r in chosen
    ]
    header = [
        "bias update rate",
        "sequence-wise loss",
        "steps",
        "MaxVio, last fifth",
        "loss, last fifth",
        "bias spread",
    ]
    return Table(header, body, chosen, align="rrrrrr")


def long_context(rows: list[dict]) -> Table:
    """Llama-3.1-8B by sequence length, and packed documents (attention within each document)."""
    chosen = [r for r in steps(rows, model="llama3.1-8b") if r["file"] == "long-context-h100.json"]
    body = [
        [
            num(r["seq_len"]),
            "1" if not r["doc_len"] else f"{r['seq_len'] // r['doc_len']} x {r['doc_len']:,} (packed)",
            seconds(r["step_time_s"]),
            num(r["tokens_per_s"]),
            f"**{r['model_tflops']}**",
            f"{r['peak_gpu_gib']} GiB",
            error(r["predicted_step_s"], r["step_time_s"]),
        ]
        for r in chosen
    ]
    header = ["sequence", "documents per row", "step", "tokens/s", "model TFLOPS", "peak GPU", "planner error"]
    return Table(header, body, chosen, align="rl" + "r" * 5)


def several_gpus(rows: list[dict]) -> Table:
    """One host, one shared copy of the state, 1 and 2 GPUs."""
    best = newest([r for r in steps(rows) if r["file"].startswith("data-parallel")], lambda r: r["gpus"])
    chosen = [best[g] for g in sorted(best)]
    one = best.get(1)
    body = [
        [
            str(r["gpus"]),
            tokens(r["tokens_per_step"]),
            seconds(r["step_time_s"]),
            num(r["tokens_per_s"]),
            f"**{r['model_tflops']}**",
            ratio(r["tokens_per_s"], one and one["tokens_per_s"]),
            str(r["host_bytes_per_param"]),
        ]
        for r in chosen
    ]
    header = [
        "GPUs",
        "tokens/step",
        "step",
        "tokens/s",
        "model TFLOPS (all GPUs)",
        "tokens/s against one GPU",
        "host B/param",
    ]
    return Table(header, body, chosen, align="r" * 7)


LARGEST = [
    ("llama3-8b", "scaling-h100.json"),
    ("llama2-13b", "scaling-h100.json"),
    ("qwen2.5-32b", "largest-qwen2.5-32b-h200.json"),
    ("qwen2.5-32b", "lora-qwen2.5-32b-h200.json"),
    ("dense-120b", "qlora-dense-120b-h200.json"),
    ("mixtral-8x22b", "qlora-mixtral-8x22b-h200.json"),
]


def largest_models(rows: list[dict]) -> Table:
    """The largest models trained on one GPU: in RAM, past RAM with the disk tier, on a larger host, and with LoRA
    over a frozen base (bf16, nf4) on the 125 GiB box."""
    chosen = [newest([r for r in steps(rows, model=m) if r["file"] == f], lambda r: 0)[0] for m, f in LARGEST]
    body = [
        [
            r["model"],
            f"{r['params_b']}B",
            training(r),
            gpu(r),
            f"{r['file_machine']['host_memory_gib']} GiB",
            f"{r['host_gib']} GiB",
            str(r["host_bytes_per_param"]),
            f"{r['disk_gib']} GiB" if r.get("disk_gib") else "-",
            f"{r['peak_gpu_gib']} GiB",
            tokens(r["tokens_per_step"]),
            seconds(r["step_time_s"]),
            num(r["tokens_per_s"]),
            f"**{r['model_tflops']}**",
        ]
        for r in chosen
    ]
    header = [
        "model",
        "params",
        "training",
        "GPU",
        "host",
        "in RAM",
        "B/param in RAM",
        "on disk",
        "peak GPU",
        "tokens/step",
        "step",
        "tokens/s",
        "model TFLOPS",
    ]
    return Table(header, body, chosen, align="lrll" + "r" * 9)


def over_100b_measured(rows: list[dict]) -> Table:
    """Models of 100B+ on one H200 with a 125 GiB host: dense-120b and Mixtral-8x22B whole with LoRA over nf4, and
    dense-120b's first layers at full precision; host memory planned against the process's peak, where each step's
    time went."""
    chosen = [r for r in steps(rows, parts=True) if r["file"].startswith("qlora-")]
    body = [
        [
            r["model"],
            r.get("scope", "whole model"),
            f"{r['params_b']}B",
            training(r),
            f"{r['planned_host_gib']} / {r['peak_rss_gib']} GiB",
            f"{r['peak_gpu_gib']} GiB",
            seconds(r["step_time_s"]),
            seconds(r["predicted_step_s"]),
            f"**{r['model_tflops']}**",
            r["flop_convention"],
            seconds(r["time_split_s_per_step"]["copy_in"]),
            seconds(r["time_split_s_per_step"]["gpu_compute_idle"]),
            f"{r['setup_s']} s",
            str(r["losses"][0]),
        ]
        for r in chosen
    ]
    header = [
        "model",
        "part",
        "params",
        "training",
        "host planned / peak RSS",
        "peak GPU",
        "step",
        "planned",
        "model TFLOPS",
        "FLOPs counted",
        "copy stream busy",
        "GPU idle",
        "setup",
        "first loss",
    ]
    return Table(header, body, chosen, align="llrlrrrrrlrrrr")


def disk_tier(rows: list[dict]) -> Table:
    """Training with AdamW moments on disk (engine.optimizer_state_dir): the disk bounds the step."""
    chosen = [r for r in steps(rows) if r.get("disk_gib")]
    body = [
        [
            r["model"],
            gpu(r),
            f"{r['disk_gib']} GiB",
            f"{r['host_gib']} GiB",
            tokens(r["tokens_per_step"]),
            seconds(r["step_time_s"]),
            num(r["tokens_per_s"]),
            f"**{r['model_tflops']}**",
            error(r.get("predicted_step_s"), r["step_time_s"]),
        ]
        for r in chosen
    ]
    header = [
        "model",
        "GPU",
        "moments on disk",
        "in RAM",
        "tokens/step",
        "step",
        "tokens/s",
        "model TFLOPS",
        "planner error",
    ]
    return Table(header, body, chosen, align="ll" + "r" * 7)


def planner_at_shape(rows: list[dict]) -> Table:
    """The planner with the block, a kept layer and the head measured at the run's own shape, against 7B-shaped defaults."""
    chosen = [r for r in rows if r.get("planner", "").endswith("(final)")]
    body = [
        [
            r["model"],
            f"{r['seq_len']} x {r['micro_batch_seqs']}",
            seconds(r["step_time_s"]),
            f"{seconds(r['predicted_with_default_rates_s'])} ({error(r['predicted_with_default_rates_s'], r['step_time_s'])})",
            f"**{seconds(r['predicted_step_s'])} ({error(r['predicted_step_s'], r['step_time_s'])})**",
            f"{r['rates']['gpu_tflops']} / {r['rates']['gpu_kept_tflops']}",
        ]
        for r in chosen
    ]
    header = [
        "model",
        "sequence x micro-batch",
        "measured",
        "planned with 7B-shaped defaults",
        "planned at its shape",
        "block / kept layer TFLOPS",
    ]
    return Table(header, body, chosen, align="ll" + "r" * 4)


def run_key(row: dict) -> tuple:
    """What makes two rows the same run: model, part, GPU, tokens per step, a long sequence, packing, the disk tier,
    clipping, and the layers' implementation (native templates or transformers' own modules)."""
    long_sequence = row["seq_len"] if row.get("seq_len", 0) > 4096 else None
    return (
        row["model"],
        part(row),
        gpu(row),
        row["tokens_per_step"],
        long_sequence,
        row.get("doc_len") or 0,
        bool(row.get("disk_gib")),
        bool(row.get("grad_clip")),
        row.get("implementation", "native"),
    )


def planner_validation(rows: list[dict]) -> Table:
    """The planner's newest prediction for each run against its measured step, across models, steps and GPUs."""
    measured = [r | {"measured_step_s": r["step_time_s"]} for r in steps(rows, parts=True) if r.get("predicted_step_s")]
    plans = [r for r in rows if r["system"] == "megatrain plan" and r.get("measured_step_s")]
    current = [r for r in measured + plans if "final" in r.get("planner", "final")]  # not an earlier planner's rates
    chosen = sorted(
        newest(current, run_key).values(), key=lambda r: (r["model"], part(r), r["tokens_per_step"], r["seq_len"])
    )
    body = []
    for r in chosen:
        name = r["model"] + ("" if part(r) == "whole model" else f", {part(r)}")
        name += f", experts in {r['expert_parts']} parts" if r.get("expert_parts") else ""
        name += ", disk tier" if r.get("disk_gib") else f", documents of {r['doc_len']}" if r.get("doc_len") else ""
        name += f", clipping at {r['grad_clip']}" if r.get("grad_clip") else ""
        name += ", through transformers' layers" if r.get("implementation") == "transformers" else ""
        shape = f"{tokens(r['tokens_per_step'])} ({r['seq_len']:,} x {r['tokens_per_step'] // r['seq_len']})"
        body.append(
            [
                name,
                gpu(r),
                shape,
                seconds(r["measured_step_s"]),
                seconds(r["predicted_step_s"]),
                error(r["predicted_step_s"], r["measured_step_s"]),
                r["date"],
            ]
        )
    header = ["run", "GPU", "tokens/step (sequence x count)", "measured", "planned", "error", "date"]
    return Table(header, body, chosen, align="ll" + "r" * 4 + "l")


def block_rates(rows: list[dict]) -> Table:
    """A decoder block's and the head's GPU rates by shape, as megatrain plan measures them."""
    chosen = [r for r in rows if "block_tflops" in r]
    body = [
        [
            r["model"],
            f"{r['seq_len']} x {r['micro_batch_seqs']}",
            num(r["d_model"]),
            f"**{r['block_tflops']}**",
            str(r["head_tflops"]),
            f"{r['gemms_alone_ms'] / r['block_ms']:.0%}",
        ]
        for r in chosen
    ]
    header = [
        "block of",
        "sequence x micro-batch",
        "d_model",
        "block TFLOPS",
        "head TFLOPS",
        "GEMMs' share of the block",
    ]
    return Table(header, body, chosen, align="llrrrr")


def dequantize(rows: list[dict]) -> Table:
    """A dense-120b layer's packed base dequantized on the GPU (`benchmarks/dequantize.py`): eager chunks against
    one compiled kernel a weight, alone and beside the layer's GEMMs (the GPU time they lose to it)."""
    chosen = [r for r in rows if r["file"] == "dequantize-h200.json"]
    body = [
        [
            r["format"],
            r["kernel"],
            f"{r['values'] / 1e9:.2f}G",
            f"{r['alone_ms']} ms",
            f"{r['g_values_per_s']}",
            f"{r['gemms_ms']} ms",
            f"{r['gemms_beside_it_ms']} ms",
            f"**{r['gpu_ms_lost']} ms**",
        ]
        for r in chosen
    ]
    header = ["format", "kernel", "values", "alone", "G values/s", "GEMMs alone", "GEMMs beside it", "GPU time lost"]
    return Table(header, body, chosen, align="llrrrrrr")


def host_adamw(rows: list[dict]) -> Table:
    """The host's AdamW over 4 fp32 arenas (`benchmarks/host_adamw.py`): torch's fused kernel against megatrain's,
    unclipped and clipped, alone and beside the GPU's copies and GEMMs, with the host's triad."""
    chosen = [r for r in rows if r["file"] == "host-adamw-h200.json"]
    ms = {(r["engine"], r["beside_gpu_work"]): r["ms"] for r in chosen}
    body = [
        [name, f"{r['bytes_per_param']} B", f"{ms[name, False]} ms", f"{ms[name, True]} ms", f"{r['gbps']} GB/s"]
        for name in dict.fromkeys(r["engine"] for r in chosen)
        for r in chosen
        if r["engine"] == name and not r["beside_gpu_work"]
    ]
    header = ["loop", "moves a parameter", "alone", "beside the GPU's work", "GB/s alone"]
    return Table(header, body, chosen, align="lrrrr")


def dense_120b_full_plans(rows: list[dict]) -> Table:
    """The whole dense-120b at full precision on one H200, planned on the rates its first 2 layers ran at
    (`benchmarks/full_precision_plans.py`)."""
    chosen = plan_rows(rows, "dense-120b-full-plans-h200.json")

    def planned(r: dict) -> list[str]:
        """The step's time, model TFLOPS and bound, where the host holds the plan."""
        if not r["host_holds_it"]:
            return ["-", "-", "-"]
        bound = BOUNDS.get(r["bound"], r["bound"])
        if r["bound"] == "cpu_optimizer":
            bound += f" ({seconds(r['optimizer_s'])} of AdamW)"
        return [seconds(r["step_time_s"]), num(r["model_tflops"]), bound]

    body = [
        [
            f"{num(r['host_size_gib'])} GiB",
            f"{r['grad_clip']:.1f}" if r["grad_clip"] else "none",
            f"{num(r['host_memory_gib'])} GiB" + ("" if r["host_holds_it"] else ": does not fit"),
            str(r["host_bytes_per_param"]),
            *planned(r),
        ]
        for r in chosen
    ]
    header = ["host", "clipping", "host memory", "B/param", "step", "model TFLOPS", "bound by"]
    return Table(header, body, chosen, align="rlrrrrl")


BOUNDS = {"compute": "GPU compute", "cpu_optimizer": "the CPU optimizer after the backward", "pcie": "PCIe"}


def lora_plans(rows: list[dict]) -> Table:
    """What one H200 fine-tunes with LoRA against full training, host by host (`benchmarks/lora_plans.py`): each
    candidate the host holds in some mode (full; LoRA over a bf16, int8 or nf4 base), and the smallest it holds in
    none."""
    chosen = plan_rows(rows, "lora-plans.json")
    modes = ["full training", "LoRA r=16 over a bf16 base", "LoRA r=16 over an int8 base", "LoRA r=16 over an nf4 base"]
    plans: dict[tuple, dict] = {}
    for r in chosen:
        plans.setdefault((r["host_size_gib"], r["params_b"], r["model"]), {})[r["mode"]] = r

    def cell(r: dict) -> str:
        held = f"{num(r['host_memory_gib'])} GiB"
        fits = r["host_holds_it"]
        return f"{held}: {seconds(r['step_time_s'])}, {num(r['model_tflops'])} TFLOPS" if fits else f"{held}: no"

    def held(by_mode: dict) -> bool:
        return any(r["host_holds_it"] for r in by_mode.values())

    smallest_held_by_none = {
        host: min((p for (h, p, _), by_mode in plans.items() if h == host and not held(by_mode)), default=math.inf)
        for host, _, _ in plans
    }
    body = [
        [f"{host:,} GiB", model, f"{params}B", *(cell(by_mode[mode]) for mode in modes)]
        for (host, params, model), by_mode in sorted(plans.items())
        if held(by_mode) or params <= smallest_held_by_none[host]
    ]
    header = [
        "host",
        "model",
        "parameters",
        "full training",
        "LoRA over bf16",
        "LoRA over int8",
        "LoRA over nf4 (QLoRA)",
    ]
    return Table(header, body, chosen, align="rlrllll")


def hosts_plans(rows: list[dict]) -> Table:
    """The largest model 1-64 hosts would train (8 H200s each, 16k tokens per GPU): a replica per host or split state."""
    chosen = plan_rows(rows, "hosts-plans.json")
    body = [
        [
            f"{r['host_size_gib']:,} GiB",
            r["state"],
            f"{r['hosts']} x 8",
            str(r["host_bytes_per_param"]),
            f"{r['largest_params_b']}B",
            r["model"],
            seconds(r["step_time_s"]),
            num(r["tokens_per_s"]),
            f"{r['network_gb_per_host']:,} GB ({r['network_s']} s)",
            r["bound"],
        ]
        for r in chosen
    ]
    header = [
        "host",
        "state",
        "hosts x GPUs",
        "B/param per host",
        "largest that fits",
        "model",
        "step",
        "tokens/s",
        "network per host per step",
        "bound",
    ]
    return Table(header, body, chosen, align="rlrrrlrrrl")


def kernel_kinds(rows: list[dict]) -> Table:
    """GPU time per kernel kind in one profiled Qwen2.5-7B step, the newest engine at 32k and 128k tokens."""
    profiled = [r for r in rows if "kinds" in r and is_default(r)]
    best = newest(profiled, lambda r: r["tokens_per_step"])
    chosen = [best[t] for t in sorted(best)]
    kinds = [k["kind"] for k in chosen[0]["kinds"]]
    ms = [{k["kind"]: k["ms_per_step"] for k in r["kinds"]} for r in chosen]
    body = [[kind] + [num(m.get(kind), 0) for m in ms] for kind in kinds]
    return Table(["kind, ms per step"] + [f"{tokens(r['tokens_per_step'])} tokens" for r in chosen], body, chosen)


def _unclipped_words(cells: list[str]) -> str:
    """A dense-7B row's note in the headline: its unclipped step's model TFLOPS, and "(another call)" where the
    two did not run in one call (the table then states no cost of clipping)."""
    if cells[3] == "-":
        return ""
    words = f"{cells[3].split(' ')[0]} without clipping"
    return f"{words} (another call)" if cells[4] == "-" else words


def headline(rows: list[dict]) -> Table:
    """The README's headline numbers, each a row of the docs' tables (linked)."""
    as_run = dense_7b_as_users_run(rows)
    lines = [
        (
            f"qwen2.5-7b, {tokens(r['tokens_per_step'])} tokens/step, clipping at 1.0",
            r,
            "benchmarks.md#dense-7b-on-one-h200-as-users-run-it",
            _unclipped_words(cells),
        )
        for r, cells in zip(as_run.sources, as_run.body)
    ]
    lines += [
        (
            f"qwen2.5-7b, {tokens(r['tokens_per_step'])} tokens/step, no clipping",
            r,
            "benchmarks.md#dense-7b-on-one-h100-by-step-size",
            "",
        )
        for r in dense_7b_by_step_size(rows).sources
    ]
    published = against_published(rows)
    lines[-1] = lines[-1][:3] + (f"{published.body[0][4]} the published layer-streaming system",)
    lora = lora_against_full(rows)
    lines += [
        (
            f"qwen2.5-7b, LoRA r=16, {tokens(r['tokens_per_step'])} tokens/step",
            r,
            "benchmarks.md#lora-over-a-frozen-7b-on-one-h200",
            f"{cells[3].strip('*')} of the full step's time",
        )
        for r, cells in zip(lora.sources, lora.body)
        if r["tokens_per_step"] == 32768
    ]
    lines += _headline_against_deepspeed(rows)
    lines += _headline_largest(rows)
    two = several_gpus(rows)
    lines.append(
        (
            "qwen2.5-7b on two GPUs of one host",
            two.sources[-1],
            "scaling.md#several-gpus-on-one-host",
            f"{two.body[-1][5]} one GPU",
        )
    )
    moe = [r for r in moe_steps(rows).sources if r["model"] == "olmoe-1b-7b" and r["tokens_per_step"] == 131072]
    lines.append(
        (
            f"olmoe-1b-7b (a mixture of experts), 128k tokens/step, {clipping_words(moe[0].get('grad_clip'))}",
            moe[0],
            "scaling.md#mixtures-of-experts",
            "",
        )
    )
    longest = max(long_context(rows).sources, key=lambda r: r["seq_len"])
    lines.append(
        (
            f"llama3.1-8b, sequences of {tokens(longest['seq_len'])} tokens",
            longest,
            "benchmarks.md#long-sequences-and-packed-documents",
            "",
        )
    )
    body = [
        [f"[{what}](docs/{link})", gpu(r), f"**{r['model_tflops']}**", versus or "-", r["date"][:10]]
        for what, r, link, versus in lines
    ]
    return Table(
        ["what", "GPU", "model TFLOPS", "against", "measured"], body, [r for _, r, _, _ in lines], align="llrll"
    )


def _headline_largest(rows: list[dict]) -> list[tuple]:
    """The headline's largest models: with LoRA over nf4 (the MoE and the dense one), at full precision, with LoRA
    over bf16 on the 125 GiB box."""
    full_32b, lora_32b, qlora_120b, qlora_141b = largest_models(rows).sources[-4:]
    over_100b = "scaling.md#100b-on-one-gpu-120b-dense-and-141b-mixture-of-experts"
    return [
        (
            "mixtral-8x22b (141B) whole, LoRA r=16 over nf4, on a 125 GiB host: the largest trained on one GPU",
            qlora_141b,
            over_100b,
            f"{qlora_141b['peak_rss_gib']} GiB host memory at peak",
        ),
        (
            "dense-120b whole, LoRA r=16 over nf4, on a 125 GiB host",
            qlora_120b,
            over_100b,
            f"{qlora_120b['peak_rss_gib']} GiB host memory at peak",
        ),
        ("qwen2.5-32b, the largest trained at full precision on one GPU", full_32b, LARGEST_ANCHOR, ""),
        (
            "qwen2.5-32b whole, LoRA r=16, on a 125 GiB host",
            lora_32b,
            LARGEST_ANCHOR,
            f"{lora_32b['peak_rss_gib']} GiB host memory at peak",
        ),
    ]


LARGEST_ANCHOR = "scaling.md#the-largest-models-on-one-gpu"


def _headline_against_deepspeed(rows: list[dict]) -> list[tuple]:
    """The headline's rows against DeepSpeed: those that clip (on the H200), and Llama-2-7B's."""
    lines, found = [], compared_runs(rows)
    for (model, _, tokens_per_step, _, clip), cells, (ours, *_) in zip(
        COMPARED, against_deepspeed(rows, found).body, found
    ):
        if clip or model == "llama2-7b":
            lines.append(
                (
                    f"{model}, {tokens(tokens_per_step)} tokens/step, {clipping_words(clip)}",
                    ours,
                    "benchmarks.md#against-deepspeed-zero-3-offload",
                    f"{cells[7]} DeepSpeed ZeRO-3 offload",
                )
            )
    return lines


TABLES: dict[str, Callable[[list[dict]], Table]] = {
    "headline": headline,
    "dense-7b-as-users-run": dense_7b_as_users_run,
    "lora-against-full": lora_against_full,
    "dense-7b-by-step-size": dense_7b_by_step_size,
    "dense-7b-time-split": dense_7b_time_split,
    "against-deepspeed": against_deepspeed,
    "against-published": against_published,
    "does-not-fit": does_not_fit,
    "families": families,
    "block-ceilings": block_ceilings,
    "linear-attention-parts": linear_attention_parts,
    "preference-training": preference_training,
    "generic-template": generic_template,
    "grpo-toy": grpo_toy,
    "grpo-speed": grpo_speed,
    "image-text": image_text,
    "moe-steps": moe_steps,
    "moe-expert-parts": moe_expert_parts,
    "moe-layers": moe_layers,
    "moe-plans": moe_plans,
    "load-balance": load_balance,
    "long-context": long_context,
    "several-gpus": several_gpus,
    "largest-models": largest_models,
    "over-100b-measured": over_100b_measured,
    "disk-tier": disk_tier,
    "planner-at-shape": planner_at_shape,
    "planner-validation": planner_validation,
    "block-rates": block_rates,
    "dense-120b-full-plans": dense_120b_full_plans,
    "dequantize": dequantize,
    "host-adamw": host_adamw,
    "hosts-plans": hosts_plans,
    "lora-plans": lora_plans,
    "kernel-kinds": kernel_kinds,
}


THROUGHPUT = "benchmarks/throughput.py"  # (its --grad-clip default: 1.0 from 0.2.0 on, 0 before)


# Rendering


def markdown(table: Table) -> list[str]:
    """The table as markdown lines."""
    align = table.align or "l" + "r" * (len(table.header) - 1)
    rule = ["---:" if a == "r" else "---" for a in align]
    return ["| " + " | ".join(cells) + " |" for cells in [table.header, rule] + table.body]


def provenance(table: Table, doc: Path) -> list[str]:
    """Under a table: each source file with its machine, the rows' dates and the commands that reproduce them."""
    lines = ["", "<details><summary>Commands, machines and dates of these rows</summary>", ""]
    by_file: dict[str, list[dict]] = {}
    for row in table.sources:
        by_file.setdefault(row["file"], []).append(row)
    for name, rows in by_file.items():
        link = Path("benchmarks/results", name)
        target = link if doc.parent == ROOT else Path("..") / link
        machines = sorted({machine_text(r) for r in rows})
        dates = sorted({r["date"] for r in rows})
        lines.append(f"- [`{link}`]({target.as_posix()}): {'; '.join(machines)}; measured {', '.join(dates)}")
        commands = [as_run_today(r["command"], r) for r in rows if r.get("command")]
        commands = list(dict.fromkeys(commands)) or [as_run_today(c, rows[0]) for c in rows[0]["file_commands"]]
        lines += ["", "  ```bash"] + [f"  {command}" for command in commands] + ["  ```", ""]
    return lines + ["</details>", ""]


def as_run_today(command: str, row: dict) -> str:
    """`command` as it reproduces `row` today: throughput.py clips at 1.0 by default (what users run), so a row that
    did not clip (every row before 0.2.0, when the default was 0) gets `--grad-clip 0` where its command is silent."""
    if THROUGHPUT in command and "--grad-clip" not in command and not row.get("grad_clip"):
        return command.replace(THROUGHPUT, f"{THROUGHPUT} --grad-clip 0", 1)
    return command


def machine_text(row: dict) -> str:
    """The machine a row ran on, in words: device, GPU memory, host memory, cores, torch."""
    machine = row["file_machine"] | (row.get("machine") or {})
    parts = [machine["device"]]
    if machine.get("gpu_memory_gib"):
        parts[0] += f" ({machine['gpu_memory_gib']} GiB)"
    if machine.get("host_memory_gib"):
        parts.append(f"{machine['host_memory_gib']} GiB host")
    if machine.get("cpu_cores"):
        parts.append(f"{machine['cpu_cores']} cores")
    if machine.get("torch"):
        parts.append(f"torch {machine['torch']}")
    return ", ".join(parts)


def render(name: str, rows: list[dict], doc: Path) -> str:
    """The generated region of table `name` as it should read in `doc`."""
    if name not in TABLES:
        raise SystemExit(f"{doc}: unknown table '{name}' (known: {', '.join(TABLES)})")
    table = TABLES[name](rows)
    if doc == README:
        below = ["", f"Commands, machines and dates of these rows: [docs/benchmarks.md]({README_SOURCES}).", ""]
    else:
        below = provenance(table, doc)
    return "\n".join([from_doc(line, doc) for line in markdown(table)] + below) + "\n"


def from_doc(line: str, doc: Path) -> str:
    """A table's line with its links to docs/ read from `doc` (tables write them from the repository root)."""
    return line.replace("](docs/", "](") if doc.parent == ROOT / "docs" else line


def regenerate(text: str, rows: list[dict], doc: Path) -> str:
    """The doc's text with every generated table region rewritten from the rows."""
    return REGION.sub(lambda m: m.group(1) + render(m.group("name"), rows, doc) + m.group(4), text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if a doc's generated tables are stale")
    args = parser.parse_args(argv)
    rows = load_rows()
    stale = []
    for doc in DOCS:
        text = doc.read_text()
        updated = regenerate(text, rows, doc)
        if updated != text:
            stale.append(doc.relative_to(ROOT).as_posix())
            if not args.check:
                doc.write_text(updated)
    if args.check and stale:
        print(f"stale generated tables in {', '.join(stale)}: run python benchmarks/tables.py", file=sys.stderr)
        return 1
    print(
        f"{'checked' if args.check else 'wrote'} {len(DOCS)} docs"
        + (f"; rewrote {', '.join(stale)}" if stale and not args.check else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
