"""The packed frozen-base formats against bitsandbytes itself (a test-only dependency, installed by the store's nox
session): NF4 with double quantization and row-wise int8, bit for bit on the CPU (and the GPU, marked gpu)."""

import dataclasses
import json

import bitsandbytes.functional as bnb
import pytest
import torch

from megatrain_store import (
    QuantizedInt8,
    QuantizedNF4,
    StoreError,
    dequantize_int8,
    dequantize_nf4,
    int8_nbytes,
    nf4_from_bitsandbytes,
    nf4_nbytes,
    quant,
    quantize_int8,
    quantize_nf4,
)
from megatrain_store.quant import NF4_CODE, _quantize_dynamic, dynamic_code

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# whole blocks; an odd count (a partial last block, a pad nibble); rows that are not whole blocks; 469 blocks (two
# blocks of statistics, the second partial); less than one block; one value
SHAPES = [(64, 64), (70, 33), (130, 48), (300, 100), (5, 7), (1, 1)]


def random_weight(shape, dtype, seed):
    """A weight of a trained model's scale: N(0, 0.02) with a few outliers, so the block absmax spread."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(shape, generator=generator) * 0.02
    outliers = torch.rand(shape, generator=generator) < 0.01
    weight[outliers] *= 20
    return weight.to(dtype)


def bnb_nf4(weight):
    """bitsandbytes' QLoRA quantization: (packed codes [ceil(n/2), 1] uint8, its QuantState)."""
    return bnb.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")


def bnb_dequantize(packed, state, dtype):
    # bitsandbytes 0.50's AVX-512 CPU kernel reads the absmax of a 2-D weight row by row, which is wrong when the
    # rows are not whole blocks of 64 ((130, 48) gives errors of the order of the weight); its flat weight
    # dequantizes right everywhere, so the reference is the flat one, reshaped
    flat = bnb.QuantState(
        state.absmax, torch.Size([state.shape.numel()]), state.code, 64, "nf4", dtype, state.offset, state.state2
    )
    # an odd count goes to bitsandbytes' torch reference, which it compiles (seconds a shape); eager is the same
    with torch.compiler.set_stance("force_eager"):
        return bnb.dequantize_4bit(packed, flat).view(state.shape)


def from_bitsandbytes(packed, state) -> QuantizedNF4:
    """bitsandbytes' arrays as a QuantizedNF4 (a transformers QLoRA checkpoint holds the same)."""
    return QuantizedNF4(
        packed.view(-1), state.absmax, state.state2.absmax, state.offset.view(1), tuple(state.shape), state.dtype
    )


def test_a_transformers_qlora_weight_reads_as_bitsandbytes_holds_it():
    """`QuantState.as_dict(packed=True)`, as transformers saves a QLoRA model's weight beside its codes, read back by
    `nf4_from_bitsandbytes`: the very arrays, so the dequantization is bitsandbytes'; another form is refused."""
    weight = random_weight((130, 48), torch.bfloat16, seed=46)
    packed, state = bnb_nf4(weight)
    parts = state.as_dict(packed=True)
    q = nf4_from_bitsandbytes("w", packed, parts, torch.float32)
    assert torch.equal(q.to_bytes(), from_bitsandbytes(packed, state).to_bytes()) and q.shape == (130, 48)
    assert torch.equal(dequantize_nf4(q), bnb_dequantize(packed, state, torch.float32))

    def state_with(**changes):
        values = json.loads(bytes(parts["quant_state.bitsandbytes__nf4"].tolist()).decode()) | changes
        return parts | {
            "quant_state.bitsandbytes__nf4": torch.tensor(list(json.dumps(values).encode()), dtype=torch.uint8)
        }

    for wrong in (
        state_with(blocksize=128),
        state_with(quant_type="fp4"),
        parts | {"quant_map": parts["quant_map"] * 2},
    ):
        with pytest.raises(StoreError, match="w: a bitsandbytes 4-bit weight megatrain does not read .* nf4"):
            nf4_from_bitsandbytes("w", packed, wrong, torch.float32)
    with pytest.raises(StoreError, match="the file is damaged"):
        nf4_from_bitsandbytes("w", packed[:-1], parts, torch.float32)


def test_code_values_are_bitsandbytes():
    assert torch.equal(torch.tensor(NF4_CODE), bnb.get_4bit_type("nf4", device="cpu"))
    assert torch.equal(dynamic_code(), bnb.create_dynamic_map())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_nf4_equals_bitsandbytes_bit_for_bit(shape, dtype):
    weight = random_weight(shape, dtype, seed=sum(shape) + len(str(dtype)))
    packed, state = bnb_nf4(weight)
    q = quantize_nf4(weight)
    assert torch.equal(q.codes, packed.view(-1))  # same nibble order and pad
    assert torch.equal(q.absmax_codes, state.absmax)
    assert torch.equal(q.absmax_scales, state.state2.absmax)
    assert torch.equal(q.offset, state.offset.view(1))
    assert (q.shape, q.dtype) == (shape, dtype)

    restored = dequantize_nf4(q)
    assert restored.dtype == dtype and restored.shape == shape
    assert torch.equal(restored, bnb_dequantize(packed, state, dtype))
    # into a slot of another compute dtype: the fp32 products rounded once to it, as bitsandbytes gives that dtype
    slot = torch.full(shape, float("nan"), dtype=torch.bfloat16)
    assert dequantize_nf4(q, out=slot) is slot
    assert torch.equal(slot, bnb_dequantize(packed, state, torch.bfloat16))
    # bitsandbytes' own arrays dequantize the same through this module
    assert torch.equal(dequantize_nf4(from_bitsandbytes(packed, state)), restored)


def test_nf4_rows_of_whole_blocks_equal_bitsandbytes_2d_kernel():
    weight = random_weight((96, 128), torch.bfloat16, seed=5)
    packed, state = bnb_nf4(weight)
    assert torch.equal(dequantize_nf4(quantize_nf4(weight)), bnb.dequantize_4bit(packed, state))


def test_nf4_zero_blocks_and_equal_absmax_equal_bitsandbytes():
    weight = random_weight((40, 64), torch.float32, seed=6)
    weight[3] = 0  # a block of zeros: absmax 0, codes 7
    weight[10:20] = 0
    equal = torch.sign(random_weight((64, 48), torch.float32, seed=7)) * 0.25  # every absmax 0.25: statistics 0
    for w in (weight, equal):
        packed, state = bnb_nf4(w)
        q = quantize_nf4(w)
        for mine, theirs in [(q.codes, packed.view(-1)), (q.absmax_codes, state.absmax)]:
            assert torch.equal(mine, theirs)
        assert torch.equal(q.absmax_scales, state.state2.absmax) and torch.equal(q.offset, state.offset.view(1))
        assert torch.equal(dequantize_nf4(q), bnb_dequantize(packed, state, w.dtype))
    assert torch.equal(dequantize_nf4(quantize_nf4(equal)), equal)  # 0.25 * nf4[15] exactly
    assert (dequantize_nf4(quantize_nf4(weight))[10:20] == 0).all()


def test_partial_last_block_is_divided_by_its_absmax_as_bitsandbytes_does():
    """Whole blocks are multiplied by 1 / absmax, a last partial block divided by its absmax: values next to the
    midpoints between NF4 codes, where the two pick different codes, in the partial block of a (1, 104) weight."""
    bounds = (torch.tensor(NF4_CODE)[:-1] + torch.tensor(NF4_CODE)[1:]) / 2
    generator = torch.Generator().manual_seed(16)
    checked = 0
    for absmax in (torch.rand(40, generator=generator) * 0.1 + 0.01).tolist():
        a = torch.tensor(absmax)
        below, above = bounds * a, bounds * a
        near = [below]
        for _ in range(3):  # the products and 3 floats either side
            below, above = torch.nextafter(below, torch.tensor(-1.0)), torch.nextafter(above, torch.tensor(1.0))
            near += [below, above]
        near = torch.cat(near)
        apart = near[torch.bucketize(near / a, bounds) != torch.bucketize(near * (1.0 / a), bounds)]
        if apart.numel() == 0:
            continue
        tail = torch.cat([a.view(1), apart[:39], torch.zeros(39 - min(39, apart.numel()))])
        weight = torch.cat([random_weight((64,), torch.float32, seed=17), tail]).view(1, 104)
        packed, _ = bnb_nf4(weight)
        assert torch.equal(quantize_nf4(weight).codes, packed.view(-1))
        checked += 1
    assert checked >= 5


def test_statistics_take_the_cpu_kernels_table_not_the_nearest_code():
    """The 8-bit codes of absmax - offset: bitsandbytes' CPU kernel rounds through a table of 65536 bins, which
    differs from the nearest code close to the midpoints between codes; values there, in blocks of 256 scaled by a
    1.0 in each (a partial last block, a block of zeros), against its quantize_blockwise."""
    generator = torch.Generator().manual_seed(8)
    code = dynamic_code()
    midpoints = (code[:-1] + code[1:]) / 2
    near = midpoints[torch.randint(255, (2000,), generator=generator)]
    near = near + (torch.rand(2000, generator=generator) - 0.5) * 2**-14
    blocks = torch.cat([torch.ones(8, 1), near[: 8 * 250].view(8, 250), torch.zeros(8, 5)], dim=1).view(-1)
    values = torch.cat([torch.zeros(256), blocks, random_weight((77,), torch.float32, seed=9)])
    codes, scales = _quantize_dynamic(values)
    theirs, state = bnb.quantize_blockwise(values, blocksize=256)
    assert torch.equal(codes, theirs) and torch.equal(scales, state.absmax)
    nearest = torch.bucketize(values[256 : 256 + blocks.numel()], midpoints)  # scale 1.0 in those blocks
    assert (nearest != codes[256 : 256 + blocks.numel()]).sum() > 10  # the table does differ here


def test_chunks_give_the_whole_tensors_bytes(monkeypatch):
    """A weight of 30000 values through chunks of 192 (3 blocks; int8: 1 row of 100): the same bytes and
    dequantized weights as in one piece."""
    weight = random_weight((300, 100), torch.bfloat16, seed=18)
    whole, whole8 = quantize_nf4(weight), quantize_int8(weight)
    monkeypatch.setattr(quant, "CHUNK", 192)
    chunked, chunked8 = quantize_nf4(weight), quantize_int8(weight)
    assert torch.equal(chunked.to_bytes(), whole.to_bytes()) and torch.equal(chunked8.to_bytes(), whole8.to_bytes())
    slot = torch.empty(300, 100, dtype=torch.float32)
    assert torch.equal(dequantize_nf4(chunked, out=slot), bnb_dequantize(*bnb_nf4(weight), torch.float32))
    assert torch.equal(dequantize_int8(chunked8), dequantize_int8(whole8))


def test_one_kernels_arithmetic_equals_the_chunks():
    """What a CUDA device compiles into one kernel (`quant._nf4_values_into`, `_int8_values_into`), run here as
    plain torch: the same bits as the chunked form, for every shape and out dtype (whole and partial blocks, a pad
    nibble, a row that is not whole blocks)."""
    for shape in SHAPES:
        weight = random_weight(shape, torch.bfloat16, seed=40 + sum(shape))
        q, q8 = quantize_nf4(weight), quantize_int8(weight)
        absmax = quant._dynamic_code(q.device).index_select(0, q.absmax_codes.int())
        absmax.mul_(q.absmax_scales.repeat_interleave(quant.ABSMAX_BLOCK)[: absmax.numel()]).add_(q.offset)
        for dtype in DTYPES:
            out, out8 = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
            quant._nf4_values_into(q.codes, absmax, quant._nf4_code(q.device), out.view(-1))
            quant._int8_values_into(
                q8.codes.view(-1), q8.scales, quant._int8_factor(q8.device), out8.view(-1), shape[-1]
            )
            assert torch.equal(out, dequantize_nf4(q, out=torch.empty(shape, dtype=dtype)))
            assert torch.equal(out8, dequantize_int8(q8, out=torch.empty(shape, dtype=dtype)))


def test_nf4_round_trip_error_within_its_bound():
    """|w - w'| <= (the widest half gap between NF4 codes) * absmax + |absmax - absmax'| per 64-block, and the
    absmax' error within the 8-bit dynamic map's widest half gap (plus a bin of the kernel's table) times its
    block's scale."""
    weight = random_weight((257, 129), torch.float32, seed=10)
    q = quantize_nf4(weight)
    restored = dequantize_nf4(q)
    n = weight.numel()
    padded = torch.zeros(-(-n // 64) * 64)
    padded[:n] = weight.view(-1)
    absmax = padded.view(-1, 64).abs().amax(dim=1)
    stored = dynamic_code()[q.absmax_codes.long()] * q.absmax_scales.repeat_interleave(256)[: absmax.numel()]
    stored = stored + q.offset
    dyn_gap = (dynamic_code().diff().max() / 2 + 2 / 65535) * q.absmax_scales.repeat_interleave(256)
    assert ((stored - absmax).abs() <= dyn_gap[: absmax.numel()] * 1.0001).all()
    nf4_gap = torch.tensor(NF4_CODE).diff().max() / 2  # 0.152, between -1 and -0.696
    bound = nf4_gap * absmax + (stored - absmax).abs() + 1e-6 * absmax
    error = torch.zeros_like(padded)
    error[:n] = (restored - weight).abs().view(-1)
    assert (error.view(-1, 64) <= bound.unsqueeze(1)).all()
    gaussian = torch.randn(256, 256, generator=torch.Generator().manual_seed(11))
    relative = (dequantize_nf4(quantize_nf4(gaussian)) - gaussian).norm() / gaussian.norm()
    assert 0.05 < relative < 0.15  # 4 bits: about 10% of a Gaussian's norm, not exact and not broken


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 64), (70, 33), (5, 1000)])
def test_int8_equals_bitsandbytes_bit_for_bit(shape, dtype):
    weight = random_weight(shape, dtype, seed=11 + sum(shape))
    codes, row_stats, _ = bnb.int8_vectorwise_quant(weight)
    q = quantize_int8(weight)
    assert torch.equal(q.codes, codes) and torch.equal(q.scales, row_stats)
    restored = dequantize_int8(q)
    assert restored.dtype == dtype
    assert torch.equal(restored, bnb.int8_vectorwise_dequant(codes, row_stats).to(dtype))
    slot = torch.empty(shape, dtype=torch.float32)
    assert torch.equal(dequantize_int8(q, out=slot), bnb.int8_vectorwise_dequant(codes, row_stats))
    # round to nearest: half a step of absmax / 127, plus the roundings of the product
    step = q.scales.unsqueeze(1) / 127
    assert ((slot - weight.float()).abs() <= step * (0.5 + 1e-5)).all()


def test_int8_row_of_zeros_is_zeros():
    weight = random_weight((6, 40), torch.bfloat16, seed=12)
    weight[2] = 0
    q = quantize_int8(weight)
    assert q.scales[2] == 0 and (q.codes[2] == 0).all()
    assert (dequantize_int8(q)[2] == 0).all()
    codes, row_stats, _ = bnb.int8_vectorwise_quant(weight)
    rows = [0, 1, 3, 4, 5]
    assert torch.equal(q.codes[rows], codes[rows]) and torch.equal(q.scales, row_stats)


def test_bytes_round_trip_and_sizes():
    weight = random_weight((70, 33), torch.bfloat16, seed=13)
    q = quantize_nf4(weight)
    n = weight.numel()
    assert q.nbytes == nf4_nbytes((70, 33)) == 4 + 4 * 1 + 37 + 1155
    buffer = q.to_bytes()
    assert buffer.dtype == torch.uint8 and buffer.shape == (q.nbytes,)
    assert buffer.data_ptr() == q.offset.data_ptr()  # a view of the parts, as quantize_nf4 lays them out
    copied = buffer.clone()
    back = QuantizedNF4.from_bytes(copied, (70, 33), torch.bfloat16)
    assert back.codes.data_ptr() == copied.data_ptr() + q.nbytes - (n + 1) // 2  # views, no copy
    assert torch.equal(dequantize_nf4(back), dequantize_nf4(q))
    # parts that do not lie back to back are copied into one buffer, in the same order
    apart = dataclasses.replace(q, codes=q.codes.clone(), offset=q.offset.clone())
    assert torch.equal(apart.to_bytes(), buffer)

    # written into a slice of a larger (pinned, in the store) buffer
    arena = torch.zeros(16 + q.nbytes + 7, dtype=torch.uint8)
    placed = quantize_nf4(weight, out=arena[16 : 16 + q.nbytes])
    assert torch.equal(arena[16 : 16 + q.nbytes], buffer) and placed.to_bytes().data_ptr() == arena.data_ptr() + 16
    with pytest.raises(StoreError, match="multiple of 4 bytes"):
        QuantizedNF4.from_bytes(arena[17 : 17 + q.nbytes], (70, 33))
    with pytest.raises(StoreError, match=f"\\[{q.nbytes}\\] uint8"):
        QuantizedNF4.from_bytes(arena[16 : 16 + q.nbytes - 1], (70, 33))

    # about 0.516 B/param at a real size (4 + 1/64 bits... 0.5 + 1/64 + 4/16384), known before quantizing
    assert 0.5156 < nf4_nbytes((4096, 11008)) / (4096 * 11008) < 0.5160
    assert int8_nbytes((4096, 11008)) == 4096 * 11008 + 4 * 4096

    q8 = quantize_int8(weight)
    assert q8.nbytes == int8_nbytes((70, 33)) == 70 * 33 + 4 * 70
    buffer8 = q8.to_bytes()
    assert buffer8.data_ptr() == q8.scales.data_ptr()
    back8 = QuantizedInt8.from_bytes(buffer8.clone(), (70, 33), torch.bfloat16)
    assert torch.equal(dequantize_int8(back8), dequantize_int8(q8))


def test_bad_inputs_are_refused_with_the_fix():
    weight = random_weight((8, 64), torch.float32, seed=14)
    with pytest.raises(StoreError, match="float32, bfloat16 or float16"):
        quantize_nf4(weight.to(torch.int32))
    with pytest.raises(StoreError, match="empty"):
        quantize_nf4(torch.empty(0, 64))
    broken = weight.clone()
    broken[1, 2] = float("nan")
    with pytest.raises(StoreError, match="inf or NaN"):
        quantize_int8(broken)
    with pytest.raises(StoreError, match="out must be a \\["):
        quantize_nf4(weight, out=torch.empty(10, dtype=torch.uint8))
    q = quantize_nf4(weight)
    with pytest.raises(StoreError, match="contiguous \\[8, 64\\]"):
        dequantize_nf4(q, out=torch.empty(64, 8).t())
    with pytest.raises(StoreError, match="contiguous \\[8, 64\\]"):
        dequantize_nf4(q, out=torch.empty(8, 63))
    with pytest.raises(StoreError, match="float32, bfloat16 or float16 slot"):
        dequantize_int8(quantize_int8(weight), out=torch.empty(8, 64, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_nf4_and_int8_equal_the_cpu_and_bitsandbytes(dtype):
    """The CPU twin: test_nf4_equals_bitsandbytes_bit_for_bit. On the GPU: the host's bytes, copied over and
    dequantized into a slot there, equal the CPU's dequantization bit for bit (and bitsandbytes' CUDA dequantize of
    its own arrays); quantizing there gives the same 4-bit codes, and the same statistics given the offset (a
    mean, which torch may sum in another order on the GPU); int8 is the same both ways."""
    cuda = torch.device("cuda")
    for shape in SHAPES:
        weight = random_weight(shape, dtype, seed=15 + sum(shape))
        q = quantize_nf4(weight)
        on_gpu = QuantizedNF4.from_bytes(q.to_bytes().to(cuda), shape, dtype)
        slot = torch.empty(shape, dtype=dtype, device=cuda)
        dequantize_nf4(on_gpu, out=slot)
        assert torch.equal(slot.cpu(), dequantize_nf4(q))
        packed, state = bnb_nf4(weight.to(cuda))
        theirs = bnb_dequantize(packed, state, dtype)
        assert torch.equal(dequantize_nf4(from_bitsandbytes(packed, state)), theirs)

        there = quantize_nf4(weight.to(cuda))
        assert torch.equal(there.codes.cpu(), q.codes)
        torch.testing.assert_close(there.offset.cpu(), q.offset, rtol=1e-6, atol=0)
        padded = torch.zeros(q.absmax_codes.numel() * 64)  # the statistics from the CPU's absmax, the GPU's offset
        padded[: weight.numel()] = weight.float().view(-1)
        codes, scales = _quantize_dynamic(padded.view(-1, 64).abs().amax(dim=1) - there.offset.cpu())
        assert torch.equal(there.absmax_codes.cpu(), codes) and torch.equal(there.absmax_scales.cpu(), scales)

        q8 = quantize_int8(weight)
        there8 = quantize_int8(weight.to(cuda))
        assert torch.equal(there8.codes.cpu(), q8.codes) and torch.equal(there8.scales.cpu(), q8.scales)
        assert torch.equal(dequantize_int8(there8).cpu(), dequantize_int8(q8))


@pytest.mark.gpu
def test_gpu_one_kernel_equals_the_chunks():
    """On the GPU, the compiled kernel (the default) and the eager chunks (`set_fused_dequantize(False)`, engine.compile: false)
    give the same bits, for a weight of more than one chunk (CHUNK values) and into slots of every float dtype."""
    cuda = torch.device("cuda")
    weight = random_weight((4099, 4111), torch.bfloat16, seed=44).to(cuda)  # 16.85M values: two chunks, odd
    q, q8 = quantize_nf4(weight), quantize_int8(weight)
    for dtype in DTYPES:
        fused = [dequantize_nf4(q, out=torch.empty_like(weight, dtype=dtype)), dequantize_int8(q8).to(dtype)]
        quant.set_fused_dequantize(False)
        try:
            eager = [dequantize_nf4(q, out=torch.empty_like(weight, dtype=dtype)), dequantize_int8(q8).to(dtype)]
        finally:
            quant.set_fused_dequantize(True)
        assert all(torch.equal(a, b) for a, b in zip(fused, eager))


def test_a_dequantization_kernel_that_cannot_compile_leaves_the_chunks_to_do_it(monkeypatch, capsys):
    """Where torch.compile cannot build the fused kernel on a machine (no compiler, an unsupported GPU), the run says so
    once and dequantizes in eager chunks from then on, rather than stopping."""

    def cannot_compile(fn):
        def run(*args):
            raise torch._dynamo.exc.TorchDynamoException("no working C compiler found\nmore detail")

        return run

    monkeypatch.setattr(quant, "_fused_kernel", cannot_compile)
    monkeypatch.setattr(quant, "_fused", True)
    out = torch.zeros(8)
    assert not quant._ran_fused(quant._int8_values_into, torch.ones(8, dtype=torch.int8), torch.ones(1), 1.0, out, 8)
    assert not quant._fused and torch.equal(out, torch.zeros(8))  # (nothing written: the chunks write it all)
    err = capsys.readouterr().err
    assert "could not build the dequantization kernel (no working C compiler found)" in err and "eager" in err
    monkeypatch.setattr(quant, "_fused_kernel", lambda fn: fn)  # (compiled: the function itself, on the CPU)
    monkeypatch.setattr(quant, "_fused", True)
    assert quant._ran_fused(quant._int8_values_into, torch.ones(8, dtype=torch.int8), torch.ones(1), 1.0, out, 8)
    assert torch.equal(out, torch.ones(8))
