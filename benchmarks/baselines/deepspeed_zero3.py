"""DeepSpeed ZeRO-3 with parameter and optimizer offload to CPU, one GPU: the same model and
tokens per step as benchmarks/throughput.py, configured as DeepSpeed's documentation
recommends for offload (pinned memory, overlap on, 5e8 buckets and prefetch, 1e9 max live
parameters, its CPU AdamW), Hugging Face gradient checkpointing, bf16. Config:
benchmarks/baselines/ds_zero3_offload.json. Prints one JSON row per point, like throughput.py.

    python benchmarks/baselines/deepspeed_zero3.py --model qwen2.5-3b --tokens 131072 --micro-batch 4

Several GPUs (data parallel, `--tokens` stays the global tokens per step):

    torchrun --standalone --nproc-per-node 2 benchmarks/baselines/deepspeed_zero3.py --model qwen2.5-7b \
        --tokens 131072 --micro-batch 8
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from common import machine, timed, write_results  # noqa: E402

from megatrain_zoo import config_to_hf, flops_per_token, preset  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-3b")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=131072, help="tokens per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--grad-clip", type=float, default=1.0, help="global norm clipping (0: none), as real runs clip"
    )
    parser.add_argument("--out", default="benchmarks/results/deepspeed.json")
    return parser.parse_args()


def zero3_model(config, ds_config):
    """transformers' model of `config` in bf16, partitioned as it is built, with gradient checkpointing."""
    import deepspeed
    import transformers

    hf_config = transformers.AutoConfig.for_model(**config_to_hf(config))
    hf_config.use_cache = False
    # under zero.Init the embedding is partitioned: transformers cannot zero its padding row (OLMoE sets one)
    hf_config.pad_token_id = None
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = transformers.AutoModelForCausalLM.from_config(
            hf_config, attn_implementation="sdpa", dtype=torch.bfloat16
        )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def seconds_per_step(engine, args, vocab_size, micro_batches):
    """Mean wall time of `args.steps` optimizer steps after `args.warmup`, each `micro_batches` random micro-batches."""

    def step():
        for _ in range(micro_batches):
            ids = torch.randint(0, vocab_size, (args.micro_batch, args.seq_len), device=engine.device)
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return timed(step, args.steps)


def main():
    args = parse_args()
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29511",
    }.items():
        os.environ.setdefault(key, value)
    import deepspeed

    config = preset(args.model)
    ds_config = json.loads((Path(__file__).parent / "ds_zero3_offload.json").read_text())
    ds_config["train_micro_batch_size_per_gpu"] = args.micro_batch
    ds_config["gradient_clipping"] = args.grad_clip
    deepspeed.init_distributed()
    world = torch.distributed.get_world_size()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    model = zero3_model(config, ds_config)
    # one point per process: deepspeed.initialize wraps the model once
    n_seqs = args.tokens // args.seq_len
    micro_batches = n_seqs // (args.micro_batch * world)
    ds_config["gradient_accumulation_steps"] = micro_batches
    ds_config["train_batch_size"] = n_seqs
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    step_s = seconds_per_step(engine, args, config.vocab_size, micro_batches)
    tokens = n_seqs * args.seq_len
    row = {
        "system": "deepspeed-zero3-offload",
        "model": args.model,
        "gpus": world,
        "params_b": round(config.n_params / 1e9, 3),
        "seq_len": args.seq_len,
        "tokens_per_step": tokens,
        "micro_batch_seqs": args.micro_batch,
        "grad_clip": args.grad_clip,
        "step_time_s": round(step_s, 3),
        "tokens_per_s": round(tokens / step_s),
        "model_tflops": round(flops_per_token(config, args.seq_len) * tokens / step_s / 1e12, 1),
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "deepspeed": deepspeed.__version__,
    }
    if torch.distributed.get_rank():
        return
    print(row, flush=True)
    results = {"benchmark": "deepspeed-zero3-offload", "machine": machine(), "config": ds_config, "args": vars(args)}
    write_results(Path(args.out), {**results, "results": [row]})


if __name__ == "__main__":
    main()
