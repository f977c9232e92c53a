"""The experts' weight gradients added straight into their fp32 gradient buffer by one grouped Triton kernel, as
`layout.add_matmul_` does for a dense layer's. torch._grouped_mm can only write a bf16 product, which the
backward then rounded, read back and added (a pass over all the experts' gradients per micro-batch): at 16k tokens
OLMoE's expert gradients take 3.40 ms this way against 4.01, Qwen3-30B-A3B's 3.24 against 4.55 (one H100,
`benchmarks/expert_grad.py`).
"""

import torch
from torch import Tensor

# The tile each program owns, the rows it reads a step, its warps and loads in flight: the fastest of the
# configurations `benchmarks/expert_grad.py` times, at OLMoE's, Qwen3-30B-A3B's and DeepSeek-V3's expert shapes on
# an H100 (OLMoE's gate-up at 16k tokens: 2.23 ms, against 2.58 at 8 warps and 2.60 for grouped_mm + add)
BLOCK_M, BLOCK_N, BLOCK_K, WARPS, STAGES = 128, 128, 64, 4, 3


def runs_on(rows: Tensor, into: Tensor) -> bool:
    """Whether the kernel adds the gradient of bf16 `rows` on CUDA into fp32 `into`."""
    return rows.is_cuda and rows.dtype == torch.bfloat16 and into.dtype == torch.float32


def add_grouped_weight_grad_(
    into: Tensor, a: Tensor, b: Tensor, ends: Tensor, config: tuple[int, int, int, int, int] | None = None
) -> None:
    """into[e] += a[rows of e]^T @ b[rows of e] for each expert e, accumulated in fp32.

    into: [n_experts, m, n] fp32 (any strides; n unit-strided is fastest); a: [rows, m], b: [rows, n], bf16, the
    rows grouped by expert; ends: [n_experts] int32, each expert's end row (read on the device: no host sync).
    `config`: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), for the benchmark that chose the default."""
    from . import expert_triton

    block_m, block_n, block_k, warps, stages = config or (BLOCK_M, BLOCK_N, BLOCK_K, WARPS, STAGES)
    a, b = a.contiguous(), b.contiguous()
    n_experts, m, n = into.shape
    grid = (_cdiv(m, block_m) * _cdiv(n, block_n), n_experts)
    expert_triton.grouped_weight_grad_into[grid](
        a, b, into, ends, m, n, a.stride(0), b.stride(0), *into.stride(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
