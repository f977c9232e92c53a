"""Triton kernels of the experts: the dispatch's copy of each token's row to its choices' rows (`copy_to_rows`), and
the experts' weight gradients added straight into their fp32 gradient buffer by one grouped kernel, as
`layout.add_matmul_` does for a dense layer's. torch._grouped_mm can only write a bf16 product, which the
backward then rounded, read back and added (a pass over all the experts' gradients per micro-batch): at 16k tokens
OLMoE's expert gradients take 3.40 ms this way against 4.01, Qwen3-30B-A3B's 3.24 against 4.55 (one H100,
`benchmarks/expert_grad.py`). An expert's whole 64-row chunks are read by the tensor-memory accelerator (TMA), its
last chunk by masked loads: on an H200 OLMoE's 3.16 -> 3.07 ms, Qwen3-30B-A3B's 3.05 -> 3.00
(`results/expert-grad-tma-h200.json`).
"""

from typing import NamedTuple

import torch
from torch import Tensor


class Tiles(NamedTuple):
    """How the kernel divides the work: the [block_m, block_n] tile each program owns, the rows it reads a step
    (block_k), its warps and loads in flight (stages); `tma`: whole row chunks read by the tensor-memory
    accelerator."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    tma: bool = False


# The fastest of the configurations `benchmarks/expert_grad.py` times at OLMoE's, Qwen3-30B-A3B's and DeepSeek-V3's
# expert shapes (on an H200; the H100's sweep, without TMA, chose the same tile) ...
DEFAULT_TILES = Tiles(128, 128, 64, 4, 3, tma=True)
# ... but where each expert sums WIDE_TILE_ROWS rows or more into a matrix WIDE_TILE_COLUMNS wide or wider, a tile
# twice as wide reads each row chunk for twice the columns: OLMoE's gate-up at 32k tokens (4,096 rows an expert)
# 3.72 ms against 3.90 (3.48 against 3.73 in an earlier call), Qwen3-30B-A3B's at 64k 5.72 against 5.96; at 2,048
# rows an expert it ran 6% slower, at 512 (DeepSeek-V3 at 16k tokens) 20% (results/expert-grad-tiles-h200.json)
WIDE_TILES = Tiles(128, 256, 64, 8, 3, tma=True)
WIDE_TILE_ROWS, WIDE_TILE_COLUMNS = 4096, 2048


def tiles_for(rows: int, n_experts: int, n: int) -> Tiles:
    """The tiles for `rows` rows grouped into `n_experts` experts' [m, n] gradients (by the rows an expert has on
    average: known on the host, where each expert's count is not)."""
    wide = rows >= WIDE_TILE_ROWS * n_experts and n >= WIDE_TILE_COLUMNS
    return WIDE_TILES if wide else DEFAULT_TILES


def runs_on(rows: Tensor, into: Tensor) -> bool:
    """Whether the kernel adds the gradient of bf16 `rows` on CUDA into fp32 `into`."""
    return rows.is_cuda and rows.dtype == torch.bfloat16 and into.dtype == torch.float32


def add_grouped_weight_grad_(into: Tensor, a: Tensor, b: Tensor, ends: Tensor, tiles: Tiles | None = None) -> None:
    """into[e] += a[rows of e]^T @ b[rows of e] for each expert e, accumulated in fp32.

    into: [n_experts, m, n] fp32 (any strides; n unit-strided is fastest); a: [rows, m], b: [rows, n], bf16, the
    rows grouped by expert; ends: [n_experts] int32, each expert's end row (read on the device: no host sync).
    `tiles`: how the kernel divides the work (None: `tiles_for` the shape; given: for the benchmark that chose it)."""
    from . import expert_triton

    a, b = a.contiguous(), b.contiguous()
    n_experts, m, n = into.shape
    if tiles is None:
        tiles = tiles_for(a.shape[0], n_experts, n)
    descriptors = _descriptors(a, b, tiles) if tiles.tma else None
    grid = (_cdiv(m, tiles.block_m) * _cdiv(n, tiles.block_n), n_experts)
    expert_triton.grouped_weight_grad_into[grid](
        a, b, into, ends, m, n, a.stride(0), b.stride(0), *into.stride(), *(descriptors or (None, None)),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, TMA=descriptors is not None,
        num_warps=tiles.warps, num_stages=tiles.stages,
    )  # fmt: skip


def _descriptors(a: Tensor, b: Tensor, tiles: Tiles) -> tuple | None:
    """TMA descriptors of `a` and `b`'s row chunks, or None where TMA can't read them: a Triton before 3.4, or a
    start or row not on 16 bytes (the accelerator's alignment)."""
    from .expert_triton import TensorDescriptor

    if TensorDescriptor is None or any(t.data_ptr() % 16 or t.stride(0) * t.element_size() % 16 for t in (a, b)):
        return None
    return (
        TensorDescriptor.from_tensor(a, [tiles.block_k, tiles.block_m]),
        TensorDescriptor.from_tensor(b, [tiles.block_k, tiles.block_n]),
    )


# (tokens, columns, warps): what one program of `copy_to_rows` copies, and its warps (`benchmarks/expert_dispatch.py`'s
# sweep: within 2% of one another but for the widest token blocks)
COPY_TILES = (4, 1024, 4)


def copies_on(h: Tensor) -> bool:
    """Whether `copy_to_rows` runs on `h` [tokens, d]: on CUDA, in a floating type Triton loads, columns unit-strided."""
    floating = h.dtype in (torch.bfloat16, torch.float16, torch.float32)
    return h.is_cuda and floating and h.dim() == 2 and h.stride(1) == 1


def copy_to_rows(h: Tensor, inverse: Tensor, rows: int, k: int, tiles: tuple[int, int, int] = COPY_TILES) -> Tensor:
    """[rows, d]: out[inverse[t * k + j]] = h[t] for each token t and choice j < k, where the inverse names a row
    (`rows`: a choice of an expert another stage holds, not copied). Each token's row is read once: a gather by each
    row's token (index_select) reads it k times, from memory, as the same token's rows lie far apart (one per
    expert). h: [tokens, d]; inverse: [tokens * k] int64, naming each of the `rows` rows once; `tiles`: (tokens,
    columns, warps) a program (given: for the benchmark that chose them)."""
    from . import expert_triton

    tokens, d = h.shape
    block_tokens, block_columns, warps = tiles
    out = h.new_empty(rows, d)
    grid = (_cdiv(tokens, block_tokens), _cdiv(d, block_columns))
    expert_triton.copy_to_rows[grid](
        h, out, inverse, tokens, d, rows, h.stride(0), K=k, BLOCK_T=block_tokens, BLOCK_D=block_columns, num_warps=warps
    )
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
