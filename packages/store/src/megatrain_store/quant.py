"""A frozen base's weights held packed on the host (issue 63, QLoRA): 4-bit NF4 with double-quantized absmax, or
8-bit rows. The store keeps the packed bytes of each weight; the GPU dequantizes them into the compute dtype inside
the layer's slot. Plain torch ops on whatever device the tensors are on; no Python loop over blocks.

The format is bitsandbytes' (`quantize_4bit(w, quant_type="nf4", blocksize=64, compress_statistics=True)`, as the
QLoRA paper defines it and as transformers/PEFT write QLoRA checkpoints), not torchao's `NF4Tensor` (torchtune's):
  - bitsandbytes takes any shape, padding the last block (below); torchao asserts that the element count is a whole
    number of 64-blocks and the blocks a whole number of its 256-blocks of scalers, which many real weights are not.
  - torchao's is a format of its own: its code values rounded to 4 decimals in the weight's dtype, the scalers on a
    linear int8 grid. bitsandbytes' is the one of QLoRA checkpoints: transformers (`bnb_4bit_use_double_quant`)
    saves these very arrays (`absmax`, `nested_absmax`, `nested_quant_map`, `nested_offset`), which can so be read
    without quantizing again.
  - bitsandbytes (0.50) runs on the CPU, so the tests compare against it bit for bit in CI.

NF4, bit for bit as bitsandbytes 0.50 computes it on the CPU (its torch reference for the 4-bit codes, its C++ CPU
kernel for the 8-bit statistics):
  - The weight is flattened row-major into n values and cut into blocks of 64; blocks run across rows. Each block's
    absmax (fp32) scales it into [-1, 1] (a multiplication by 1 / absmax; a last partial block of n % 64 values is
    divided by its absmax instead, as bitsandbytes' reference does), and each value takes the nearest of the 16
    NF4 code values (ties to the lower). A block of zeros has absmax 0 and codes 7 (0.0).
  - Two codes a byte, the first value in the high nibble. An odd n gets one pad value 0.0 (code 7) in the low
    nibble of the last byte, so the codes take ceil(n / 2) bytes.
  - Double quantization: offset = mean of the absmax (fp32); absmax - offset is cut into blocks of 256, each
    scaled by its own absmax (fp32, `absmax_scales`) and coded in 8 bits on bitsandbytes' signed dynamic map
    (`create_dynamic_map()`). The CPU kernel picks the code through a 65536-entry table of [-1, 1] (index
    trunc((x + 1) / 2 * 65535 + 0.5)), not by the exact nearest code value: about 0.1% of
    the codes differ, so that is followed here. A block of 256 zeros gets code 0.
  - Dequantized: absmax = dyn[code] * scale + offset (two fp32 roundings), value = nf4[code] * absmax (fp32),
    rounded once to the compute dtype. bitsandbytes' CPU, CUDA and torch kernels all dequantize so.
  bitsandbytes' CUDA quantizer differs from its CPU one in two corners (a binary search to the exact nearest 8-bit
  code; a multiplication, not a division, in the last partial block), so a base quantized by it on a GPU can differ
  in rare codes; its dequantization is the same everywhere. This module quantizes the same way on every device
  except for the mean's summation order, which torch may change between devices.

Size: ceil(n/2) + ceil(n/64) + 4 * ceil(n/64/256) + 4 bytes, about 0.516 B/param.

int8 (bitsandbytes' LLM.int8 storage, `int8_vectorwise_quant` / `int8_vectorwise_dequant`): each row of [out, in]
scaled by its absmax s (fp32) to round(w * (127 / s)) in int8 (half to even); dequantized as (q * s) * (1/127 in
fp32), rounded to the compute dtype. A row of zeros gets s = 0 and codes 0 (bitsandbytes leaves it undefined).
Size: out * in + 4 * out bytes.

Byte buffers (`to_bytes` / `from_bytes`): the fp32 parts first, then the uint8 parts, back to back and unpadded,
so a buffer that starts at a multiple of 4 bytes holds every part aligned; the shape and dtype are not in it (the
group's layout knows them).
"""

import json
import math
import sys
from dataclasses import dataclass
from functools import cache

import torch
from torch import Tensor

from .errors import StoreError, WeightsError

BLOCK = 64  # values per NF4 block, each with its own absmax
ABSMAX_BLOCK = 256  # absmax values per block of the double quantization, each with its own fp32 scale
CHUNK = 1 << 24  # values (whole blocks) quantized or dequantized at a time, bounding the temporaries

# The 16 NF4 code values in code order (QLoRA, appendix E; bitsandbytes' `get_4bit_type("nf4")`): quantiles of
# N(0, 1) normalized to [-1, 1], 8 on the positive side and 7 on the negative, with an exact 0.
NF4_CODE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
_LUT_SIZE = 65536  # bins of [-1, 1] in bitsandbytes' CPU table from a value to its 8-bit code
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class QuantizedNF4:
    """One weight in NF4 with double-quantized absmax: flat tensors on one device (see the module docstring)."""

    codes: Tensor  # [ceil(n / 2)] uint8, two NF4 codes a byte, the first value in the high nibble
    absmax_codes: Tensor  # [ceil(n / 64)] uint8, each block's absmax - offset on the 8-bit dynamic map
    absmax_scales: Tensor  # [ceil(ceil(n / 64) / 256)] fp32, the absmax of each 256 (absmax - offset)
    offset: Tensor  # [1] fp32, the mean of the absmax
    shape: tuple[int, ...]  # the weight's shape, n = prod(shape)
    dtype: torch.dtype  # what dequantize_nf4 gives back without `out`

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed weight, about 0.516 per parameter."""
        return nf4_nbytes(self.shape)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def to_bytes(self) -> Tensor:
        """[nbytes] uint8: offset, absmax_scales, absmax_codes, codes back to back; a view without a copy when the
        parts already lie so in one buffer (as quantize_nf4 and from_bytes leave them), else a new tensor."""
        return _join(self.offset, self.absmax_scales, self.absmax_codes, self.codes)

    @staticmethod
    def from_bytes(buffer: Tensor, shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> "QuantizedNF4":
        """Views into `buffer` ([nf4_nbytes(shape)] uint8, starting at a multiple of 4 bytes), no copy."""
        shape = tuple(shape)
        sizes = _nf4_part_sizes(math.prod(shape))
        offset, scales, absmax_codes, codes = _split(buffer, sizes, ("float32", "float32", "uint8", "uint8"))
        return QuantizedNF4(codes, absmax_codes, scales, offset, shape, dtype)


@dataclass(frozen=True)
class QuantizedInt8:
    """One weight in row-wise int8 (bitsandbytes' LLM.int8 storage): flat tensors on one device."""

    codes: Tensor  # [out, in] int8, round(w * 127 / row absmax)
    scales: Tensor  # [out] fp32, each row's absmax
    shape: tuple[int, ...]  # the weight's shape; rows are all dimensions but the last
    dtype: torch.dtype  # what dequantize_int8 gives back without `out`

    @property
    def nbytes(self) -> int:
        """Bytes of the packed weight: 1 per parameter and 4 per row."""
        return int8_nbytes(self.shape)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def to_bytes(self) -> Tensor:
        """[nbytes] uint8: scales then codes; a view when they already lie so in one buffer, else a new tensor."""
        return _join(self.scales, self.codes)

    @staticmethod
    def from_bytes(buffer: Tensor, shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> "QuantizedInt8":
        """Views into `buffer` ([int8_nbytes(shape)] uint8, starting at a multiple of 4 bytes), no copy."""
        shape = tuple(shape)
        rows, cols = _rows_cols(shape)
        scales, codes = _split(buffer, (4 * rows, rows * cols), ("float32", "int8"))
        return QuantizedInt8(codes.view(rows, cols), scales, shape, dtype)


BITSANDBYTES_NF4_PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map", "quant_state.bitsandbytes__nf4")


def nf4_from_bitsandbytes(name: str, weight: Tensor, parts: dict[str, Tensor], dtype: torch.dtype) -> QuantizedNF4:
    """A weight as a transformers QLoRA checkpoint holds it (bitsandbytes' `Linear4bit`: `NAME` the packed codes,
    and `NAME.` + each of BITSANDBYTES_NF4_PARTS, `QuantState.as_dict(packed=True)`) as a QuantizedNF4 whose
    dequantization in `dtype` is bitsandbytes' own: the same arrays. Refused in one line: another 4-bit type, block
    size or code map, or statistics not double-quantized."""
    state = json.loads(bytes(parts["quant_state.bitsandbytes__nf4"].tolist()).decode())
    expected = {"quant_type": "nf4", "blocksize": BLOCK, "nested_blocksize": ABSMAX_BLOCK, "nested_dtype": "float32"}
    wrong = {key: state.get(key) for key, value in expected.items() if state.get(key) != value}
    maps_match = torch.equal(parts["quant_map"].float(), torch.tensor(NF4_CODE)) and torch.equal(
        parts["nested_quant_map"].float(), dynamic_code()
    )
    if wrong or not maps_match or "nested_offset" not in state:
        raise WeightsError(
            f"{name}: a bitsandbytes 4-bit weight megatrain does not read ({wrong or 'another code map'}); it reads "
            "NF4 with double quantization, blocks of 64 (bnb_4bit_quant_type: nf4, bnb_4bit_use_double_quant: true)"
        )
    shape = tuple(state["shape"])
    if weight.numel() != -(-math.prod(shape) // 2):
        raise WeightsError(
            f"{name}: {weight.numel()} bytes of codes for a weight of shape {shape}; the file is damaged"
        )
    offset = torch.tensor([state["nested_offset"]], dtype=torch.float32)
    return QuantizedNF4(
        weight.reshape(-1), parts["absmax"].reshape(-1), parts["nested_absmax"].float(), offset, shape, dtype
    )


def nf4_nbytes(shape: tuple[int, ...]) -> int:
    """Bytes of a weight of this shape in NF4 (QuantizedNF4.nbytes), known before quantizing it."""
    return sum(_nf4_part_sizes(math.prod(shape)))


def int8_nbytes(shape: tuple[int, ...]) -> int:
    """Bytes of a weight of this shape in row-wise int8 (QuantizedInt8.nbytes)."""
    rows, cols = _rows_cols(tuple(shape))
    return rows * cols + 4 * rows


def quantize_nf4(weight: Tensor, out: Tensor | None = None) -> QuantizedNF4:
    """weight: [out, in] (any shape) fp32, bf16 or fp16 -> its NF4 form on weight's device, equal to bitsandbytes'
    quantize_4bit(weight, quant_type="nf4", blocksize=64, compress_statistics=True) on the CPU. `out`: a
    [nf4_nbytes(weight.shape)] uint8 buffer (e.g. a slice of a pinned arena) to write into; the result's tensors
    are views into it. Works through CHUNK values at a time (about 20 bytes of temporaries each)."""
    _check_weight(weight, "quantize_nf4")
    n = weight.numel()
    buffer = _output_buffer(out, nf4_nbytes(weight.shape), weight.device, "quantize_nf4")
    q = QuantizedNF4.from_bytes(buffer, tuple(weight.shape), weight.dtype)
    flat = weight.detach().reshape(-1)
    absmax = torch.empty(q.absmax_codes.numel(), dtype=torch.float32, device=weight.device)
    for start in range(0, n, CHUNK):  # CHUNK is whole blocks and bytes: the chunks' codes are the whole's
        stop = min(start + CHUNK, n)
        codes = q.codes[start // 2 : -(-stop // 2)]
        _quantize_nf4_chunk(flat[start:stop], absmax[start // BLOCK : -(-stop // BLOCK)], codes)
    q.offset.copy_(absmax.mean())
    absmax_codes, scales = _quantize_dynamic(absmax - q.offset)
    q.absmax_codes.copy_(absmax_codes)
    q.absmax_scales.copy_(scales)
    return q


def dequantize_nf4(q: QuantizedNF4, out: Tensor | None = None) -> Tensor:
    """q -> the weight [q.shape] in q.dtype, or written into `out` ([q.shape], contiguous, any float dtype, on q's
    device: a slot's view) in out's dtype; equal bit for bit to bitsandbytes' dequantize_4bit. On a CUDA device one
    compiled kernel writes the weight (`set_fused_dequantize`); elsewhere it works through CHUNK values at a time: 6 bytes of
    temporaries each (the codes as int32 indices, the values in fp32)."""
    n = q.numel
    out = _check_out(out, q.shape, q.device, "dequantize_nf4")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    absmax = _dynamic_code(q.device).index_select(0, q.absmax_codes.int())
    absmax.mul_(q.absmax_scales.repeat_interleave(ABSMAX_BLOCK)[: absmax.numel()]).add_(q.offset)
    flat = out.view(-1)
    if _fused and q.device.type == "cuda" and _ran_fused(_nf4_values_into, q.codes, absmax, _nf4_code(q.device), flat):
        return out
    for start in range(0, n, CHUNK):
        stop = min(start + CHUNK, n)
        values = _nf4_pairs(q.device).index_select(0, q.codes[start // 2 : -(-stop // 2)].int())
        values = values.view(-1)[: stop - start]  # fp32 nf4[code]
        full = (stop - start) // BLOCK
        values[: full * BLOCK].view(full, BLOCK).mul_(absmax[start // BLOCK :][:full].unsqueeze(1))
        if (stop - start) % BLOCK:
            values[full * BLOCK :].mul_(absmax[-1])
        flat[start:stop].copy_(values)  # rounded once to out's dtype
    return out


def quantize_int8(weight: Tensor, out: Tensor | None = None) -> QuantizedInt8:
    """weight: [out, in] (rows: all dimensions but the last) fp32, bf16 or fp16 -> row-wise int8 on weight's
    device, equal to bitsandbytes' int8_vectorwise_quant(weight) on the CPU for rows that are not all zero. `out`:
    a [int8_nbytes(weight.shape)] uint8 buffer to write into, as in quantize_nf4. Works through about CHUNK values
    (whole rows) at a time."""
    _check_weight(weight, "quantize_int8")
    buffer = _output_buffer(out, int8_nbytes(weight.shape), weight.device, "quantize_int8")
    q = QuantizedInt8.from_bytes(buffer, tuple(weight.shape), weight.dtype)
    rows, cols = q.codes.shape
    matrix = weight.detach().reshape(rows, cols)
    step = max(1, CHUNK // cols)
    for start in range(0, rows, step):
        part, scales = matrix[start : start + step], q.scales[start : start + step]
        scales.copy_(part.abs().amax(dim=1))  # exact in fp32 from any of the float dtypes
        factor = torch.where(scales > 0, 127.0 / scales, 0.0)  # a row of zeros: codes 0, not 0 * inf
        q.codes[start : start + step].copy_(torch.round(part * factor.unsqueeze(1)))
    return q


def dequantize_int8(q: QuantizedInt8, out: Tensor | None = None) -> Tensor:
    """q -> the weight [q.shape] in q.dtype, or written into `out` ([q.shape], contiguous, on q's device) in its
    dtype; equal bit for bit to bitsandbytes' int8_vectorwise_dequant(codes, scales) rounded to that dtype. On a
    CUDA device one compiled kernel writes the weight (`set_fused_dequantize`); elsewhere it works through about CHUNK values
    (whole rows) at a time, 4 bytes of temporaries each."""
    out = _check_out(out, q.shape, q.device, "dequantize_int8")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    rows, cols = q.codes.shape
    fused_args = (q.codes.view(-1), q.scales, _int8_factor(q.device), out.view(-1), cols)
    if _fused and q.device.type == "cuda" and _ran_fused(_int8_values_into, *fused_args):
        return out
    matrix = out.view(rows, cols)
    step = max(1, CHUNK // cols)
    for start in range(0, rows, step):
        codes, scales = q.codes[start : start + step], q.scales[start : start + step]
        values = (codes * scales.unsqueeze(1)).mul_(1 / 127)  # bitsandbytes' order: (q * s) * fp32(1 / 127)
        matrix[start : start + step].copy_(values)
    return out


def set_fused_dequantize(enabled: bool) -> None:
    """Whether a CUDA device dequantizes each weight in one kernel that torch.compile builds on first use (the
    default), or in chunks of eager operations (engine.compile: false). Both give the same bits. The eager form
    reads and writes about 22 bytes a value (codes as indices, fp32 values, the product, the rounding) in five
    kernels a chunk, the fused one 2.6 (the codes once, the out once): on a GPU that computes beside it, the
    dequantization's share of the memory bandwidth."""
    global _fused
    _fused = enabled


_fused = True


def _nf4_values_into(codes: Tensor, absmax: Tensor, code_values: Tensor, out: Tensor) -> None:
    """out[i] = nf4[code i] * absmax[i // 64] in fp32, rounded once to out's dtype; code i is the high nibble of
    codes[i // 2] for an even i, the low one for an odd i. As one compiled kernel: no temporaries, each byte of
    the codes read once, each value of out written once."""
    i = torch.arange(out.numel(), device=out.device)
    byte = codes[i // 2].to(torch.int32)
    code = torch.where(i % 2 == 0, byte >> 4, byte & 15)
    out.copy_(code_values[code] * absmax[i // BLOCK])


def _int8_values_into(codes: Tensor, scales: Tensor, factor: Tensor, out: Tensor, cols: int) -> None:
    """out[i] = (codes[i] * scales[i // cols]) * factor in fp32 (two roundings, bitsandbytes' order; factor: fp32
    1 / 127), rounded once to out's dtype."""
    i = torch.arange(out.numel(), device=out.device)
    out.copy_(codes.to(torch.float32) * scales[i // cols] * factor)


def _ran_fused(fn, *args) -> bool:
    """Run `fn`'s compiled kernel on `args`; where torch.compile cannot build it on this machine (no compiler, an
    unsupported GPU), say so once, dequantize in eager chunks from then on (the same bits), and return False."""
    global _fused
    try:
        _fused_kernel(fn)(*args)
        return True
    except torch._dynamo.exc.TorchDynamoException as error:
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        print(
            f"megatrain: torch.compile could not build the dequantization kernel ({first_line}); dequantizing in "
            "eager chunks instead (the same bits, more GPU memory traffic; engine.compile: false skips the attempt)",
            file=sys.stderr,
        )
        _fused = False
        return False


@cache
def _fused_kernel(fn):
    """`fn` compiled once for every size (dynamic shapes: a model's weights come in a few sizes each)."""
    return torch.compile(fn, dynamic=True)


@cache
def _nf4_code(device: torch.device) -> Tensor:
    """[16] fp32: the NF4 code values in code order."""
    return torch.tensor(NF4_CODE, dtype=torch.float32, device=device)


@cache
def _int8_factor(device: torch.device) -> Tensor:
    """[] fp32 1 / 127, the factor bitsandbytes' int8 dequantization multiplies by."""
    return torch.tensor(1 / 127, dtype=torch.float32, device=device)


def _quantize_nf4_chunk(values: Tensor, absmax: Tensor, codes: Tensor) -> None:
    """values: [m] of the weight (m a multiple of 64 but in the last chunk) -> their blocks' absmax [ceil(m / 64)]
    fp32 and their packed codes [ceil(m / 2)] uint8, written into the given views."""
    x = values.float()
    m = x.numel()
    full = m // BLOCK  # whole blocks; a last partial block of m % BLOCK values follows
    scaled = torch.zeros(2 * codes.numel(), dtype=torch.float32, device=x.device)  # the pad value is 0.0
    blocks = x[: full * BLOCK].view(full, BLOCK)
    torch.amax(blocks.abs(), dim=1, out=absmax[:full])
    torch.mul(blocks, (1.0 / absmax[:full].clamp(min=1e-38)).unsqueeze(1), out=scaled[: full * BLOCK].view(full, BLOCK))
    if m % BLOCK:
        tail = x[full * BLOCK :]
        absmax[full] = tail.abs().amax()
        torch.div(tail, absmax[full].clamp(min=1e-38), out=scaled[full * BLOCK : m])
    scaled.clamp_(-1.0, 1.0)
    index = torch.bucketize(scaled, _nf4_bounds(x.device), out_int32=True)  # nearest code, ties to the lower
    codes.copy_((index[0::2] << 4) | index[1::2])


def dynamic_code() -> Tensor:
    """[256] fp32, sorted: bitsandbytes' signed 8-bit dynamic map (`create_dynamic_map()`, Dettmers 2016): for
    each exponent e = 0..6, the midpoints of 2**e + 1 evenly spaced points of [0.1, 1] times 10**(e - 6), with
    both signs; then 0 and 1."""
    values = [torch.tensor([0.0, 1.0])]
    for e in range(7):
        edges = torch.linspace(0.1, 1.0, 2**e + 1, dtype=torch.float32)
        positive = (edges[:-1] + edges[1:]) / 2 * 10.0 ** (e - 6)
        values += [positive, -positive]
    return torch.cat(values).sort().values


def _quantize_dynamic(values: Tensor) -> tuple[Tensor, Tensor]:
    """values: [m] fp32 -> ([m] uint8 codes on the dynamic map, [ceil(m / 256)] fp32 block absmax), as
    bitsandbytes' CPU kernel `quantize_blockwise(values, blocksize=256)` computes them."""
    m = values.numel()
    blocks = torch.zeros(-(-m // ABSMAX_BLOCK), ABSMAX_BLOCK, device=values.device)  # zeros change no absmax
    blocks.view(-1)[:m] = values
    scales = blocks.abs().amax(dim=1)
    inverse = torch.where(scales > 0, 1.0 / scales, 0.0)  # fp32 1 / absmax, as the kernel; zero blocks below
    scaled = (blocks * inverse.unsqueeze(1)).clamp_(-1.0, 1.0)
    # the table's index, trunc((x + 1) * 0.5 * 65535 + 0.5) in fp32: the kernel fuses the last multiply-add, but
    # the bounds k + 0.5 and k + 1 are floats, so no rounding crosses one and both give the exact value's floor
    index = ((scaled + 1.0) * 0.5 * (_LUT_SIZE - 1) + 0.5).long()
    codes = _dynamic_lut(values.device)[index]
    codes[scales == 0] = 0  # the kernel's rule for a block of zeros
    return codes.view(-1)[:m], scales


@cache
def _dynamic_code(device: torch.device) -> Tensor:
    return dynamic_code().to(device)


@cache
def _dynamic_lut(device: torch.device) -> Tensor:
    """[65536] uint8: bin i of [-1, 1] (the value -1 + 2i / 65535 in fp32) -> the code whose interval holds it,
    i.e. the number of midpoints between neighbouring codes below it."""
    code = dynamic_code()
    midpoints = 0.5 * (code[:-1] + code[1:])
    grid = -1.0 + (2.0 * torch.arange(_LUT_SIZE, dtype=torch.float32)) / (_LUT_SIZE - 1)
    return torch.searchsorted(midpoints, grid).to(torch.uint8).to(device)


@cache
def _nf4_bounds(device: torch.device) -> Tensor:
    """[15] fp32: the midpoints between neighbouring NF4 code values."""
    code = torch.tensor(NF4_CODE, dtype=torch.float32)
    return ((code[:-1] + code[1:]) / 2).to(device)


@cache
def _nf4_pairs(device: torch.device) -> Tensor:
    """[256, 2] fp32: a packed byte -> (nf4[high nibble], nf4[low nibble])."""
    code = torch.tensor(NF4_CODE, dtype=torch.float32)
    byte = torch.arange(256)
    return torch.stack([code[byte >> 4], code[byte & 15]], dim=1).to(device)


def _nf4_part_sizes(n: int) -> tuple[int, int, int, int]:
    """Bytes of (offset, absmax_scales, absmax_codes, codes) for n values."""
    n_blocks = -(-n // BLOCK)
    return 4, 4 * -(-n_blocks // ABSMAX_BLOCK), n_blocks, -(-n // 2)


def _rows_cols(shape: tuple[int, ...]) -> tuple[int, int]:
    if not shape:
        raise StoreError("row-wise int8 needs a weight of at least one dimension, got a scalar")
    return math.prod(shape[:-1]), shape[-1]


def _check_weight(weight: Tensor, what: str) -> None:
    if weight.dtype not in _FLOAT_DTYPES:
        raise StoreError(f"{what}: the weight is {weight.dtype}; give it as float32, bfloat16 or float16")
    if weight.numel() == 0:
        raise StoreError(f"{what}: the weight {tuple(weight.shape)} is empty; hold empty tensors unquantized")
    if not torch.isfinite(weight).all():
        raise StoreError(f"{what}: the weight {tuple(weight.shape)} holds inf or NaN; check the checkpoint")


def _output_buffer(out: Tensor | None, nbytes: int, device: torch.device, what: str) -> Tensor:
    if out is None:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    if out.dtype != torch.uint8 or out.shape != (nbytes,) or out.device != device:
        raise StoreError(
            f"{what}: out must be a [{nbytes}] uint8 tensor on {device}, got {list(out.shape)} {out.dtype} on "
            f"{out.device}"
        )
    return out


def _check_out(out: Tensor | None, shape: tuple[int, ...], device: torch.device, what: str) -> Tensor | None:
    if out is None:
        return None
    if tuple(out.shape) != shape or out.device != device or not out.is_contiguous():
        raise StoreError(
            f"{what}: out must be a contiguous {list(shape)} tensor on {device}, got {list(out.shape)} on "
            f"{out.device}{'' if out.is_contiguous() else ', not contiguous'}"
        )
    if out.dtype not in _FLOAT_DTYPES:
        raise StoreError(f"{what}: out is {out.dtype}; give a float32, bfloat16 or float16 slot")
    return out


def _split(buffer: Tensor, sizes: tuple[int, ...], dtypes: tuple[str, ...]) -> list[Tensor]:
    """Views of `buffer` ([sum(sizes)] uint8) as consecutive parts of these byte sizes and dtypes."""
    total = sum(sizes)
    if buffer.dtype != torch.uint8 or buffer.shape != (total,) or not buffer.is_contiguous():
        raise StoreError(
            f"a packed weight needs a contiguous [{total}] uint8 buffer, got {list(buffer.shape)} {buffer.dtype}"
        )
    if buffer.data_ptr() % 4:
        raise StoreError("a packed weight's buffer must start at a multiple of 4 bytes; align each entry's start")
    parts, start = [], 0
    for size, dtype in zip(sizes, dtypes):
        parts.append(buffer[start : start + size].view(getattr(torch, dtype)))
        start += size
    return parts


def _join(*parts: Tensor) -> Tensor:
    """The parts' bytes back to back: a view of their common buffer when they already lie so, else a copy."""
    flat = [p.reshape(-1).view(torch.uint8) for p in parts]
    first = flat[0]
    adjacent = all(p.is_contiguous() for p in parts) and all(
        b.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and b.data_ptr() == a.data_ptr() + a.numel()
        for a, b in zip(flat, flat[1:])
    )
    if not adjacent:
        return torch.cat(flat)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (sum(p.numel() for p in flat),))
