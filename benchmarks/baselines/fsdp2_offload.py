"""PyTorch FSDP2 with CPUOffloadPolicy (torch's own parameter, gradient and optimizer-state offload)
on N GPUs of one host: the baseline for `benchmarks/data_parallel.py`. The same model (Hugging Face
transformers' implementation of a megatrain_zoo preset), the same tokens per GPU, bf16 compute
with fp32 parameters and reductions, activation checkpointing per layer, one fully_shard unit per
decoder layer, torch.optim.AdamW on the CPU-resident shards. Rank 0 prints one JSON row and
appends it to --out.

    torchrun --standalone --nproc-per-node 2 benchmarks/baselines/fsdp2_offload.py \
        --model qwen2.5-7b --tokens-per-gpu 65536 --out fsdp2.json
"""

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parents[1]))
from common import base_row, machine  # noqa: E402

from megatrain_zoo import config_to_hf, preset  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-7b")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--tokens-per-gpu", type=int, default=65536)
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per forward/backward")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/fsdp2.json")
    return parser


def _sharded_model(zoo, cuda: bool, rank: int):
    """transformers' model of `zoo`, each layer and the whole sharded by FSDP2 with its parameters in pinned host
    memory (bf16 compute on the GPU), initialised as Hugging Face does, with per-layer activation checkpointing."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**config_to_hf(zoo))
    hf_config._attn_implementation = "sdpa" if cuda else "eager"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    model.config.use_cache = False
    model.gradient_checkpointing_enable({"use_reentrant": False})
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if cuda else torch.float32, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=cuda)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mixed, offload_policy=offload)
    fully_shard(model, mp_policy=mixed, offload_policy=offload)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for name, param in model.named_parameters():
            local = param.to_local()
            if name.endswith("norm.weight"):
                local.fill_(1.0)
            else:
                local.normal_(0.0, zoo.initializer_range, generator=generator)
    return model


def _timed_steps(step, args, cuda: bool) -> tuple[float, list[float]]:
    """(seconds per step, the steps' losses) after `args.warmup` untimed steps, every rank together."""
    for _ in range(args.warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    wall = time.perf_counter()
    losses = [step() for _ in range(args.steps)]
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    return (time.perf_counter() - wall) / args.steps, losses


def main():
    args = _parser().parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))

    zoo = preset(args.model)
    start = time.perf_counter()
    model = _sharded_model(zoo, cuda, rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    setup_s = time.perf_counter() - start

    n_seqs = args.tokens_per_gpu // args.seq_len
    batch_generator = torch.Generator().manual_seed(1234 + rank)

    def step() -> float:
        total = 0.0
        for _ in range(n_seqs // args.micro_batch):
            ids = torch.randint(0, zoo.vocab_size, (args.micro_batch, args.seq_len), generator=batch_generator)
            ids = ids.to(device)
            loss = model(input_ids=ids, labels=ids).loss / (n_seqs // args.micro_batch)
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    step_s, losses = _timed_steps(step, args, cuda)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20])
    dist.all_reduce(rss)  # this host's ranks together
    if rank == 0:
        tokens = args.tokens_per_gpu * world
        row = base_row(
            "fsdp2-cpu-offload", args.model, zoo, args.seq_len, tokens // args.seq_len, args.micro_batch, step_s
        )
        row |= {
            "gpus": world,
            "tokens_per_gpu": args.tokens_per_gpu,
            "host_peak_rss_gib_all_ranks": round(rss.item(), 1),
            "host_bytes_per_param": round(rss.item() * 2**30 / zoo.n_params, 2),
            "setup_s": round(setup_s, 1),
            "losses": [round(x, 4) for x in losses],
            "torch": torch.__version__,
            "machine": machine(),
        }
        print(json.dumps(row), flush=True)
        with open(args.out, "a") as handle:
            handle.write(json.dumps(row) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
