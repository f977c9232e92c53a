"""A frozen base held packed in the store (issue 63): each group's matrices quantized, its vectors and routers raw,
unpacked bit for bit as the formats' own dequantization gives them (`test_quant.py` checks those against
bitsandbytes), written through `writing` and read through `weights`, with the bytes the planner counts."""

import pytest
import torch

from megatrain_store import (
    GroupLayout,
    HostStore,
    PackedLayout,
    SharedArenas,
    StoreError,
    dequantize_int8,
    dequantize_nf4,
    quantize_int8,
    quantize_nf4,
)

LAYER = [  # a decoder layer's base as the zoo lays it out: norms and biases raw, matrices packed, a router raw
    ("model.layers.0.input_layernorm.weight", (48,), False),
    ("model.layers.0.self_attn.q_proj.weight", (48, 48), True),
    ("model.layers.0.self_attn.q_proj.bias", (48,), False),
    ("model.layers.0.mlp.gate.weight", (4, 48), True),
    ("model.layers.0.mlp.experts.gate_up_proj", (4, 66, 48), True),
    ("model.layers.0.mlp.down_proj.weight", (48, 33), True),
]
BIASES = [  # biases held as matrices: gpt-oss' experts' stacked, ERNIE 4.5's router correction bias split hi + lo
    ("model.layers.0.mlp.experts.gate_up_proj_bias", (4, 66), False),
    ("model.layers.0.mlp.moe_statics.e_score_correction_bias{hi}", (1, 4), False),
    ("model.layers.0.mlp.moe_statics.e_score_correction_bias{lo}", (1, 4), False),
]
EMBED = [("model.embed_tokens.weight", (40, 48), True)]
ADAPTER = [("model.layers.0.self_attn.q_proj.lora_A.weight", (4, 48), True)]
QUANTIZE = {"nf4": (quantize_nf4, dequantize_nf4), "int8": (quantize_int8, dequantize_int8)}


def store_of(format, dtype, layer=LAYER, **kwargs):
    layouts = [GroupLayout.from_specs(specs) for specs in (EMBED, layer, ADAPTER)]
    return HostStore(
        layouts,
        dtype,
        ("exp_avg", "exp_avg_sq"),
        frozen=frozenset({0, 1}),
        frozen_in_compute_dtype=True,
        packed=frozenset({1}),
        packed_format=format,
        **kwargs,
    )


def fill(store, group, seed):
    generator = torch.Generator().manual_seed(seed)
    with store.writing(group) as views:
        drawn = {name: torch.randn(view.shape, generator=generator) * 0.02 for name, view in views.items()}
        for name, view in views.items():
            view.copy_(drawn[name])
    return drawn


@pytest.mark.parametrize("format", ["nf4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_group_unpacks_to_its_formats_dequantized_weights(format, dtype):
    store = store_of(format, dtype, pin=False, layer=LAYER + BIASES)
    drawn = fill(store, 1, seed=0)
    quantize, dequantize = QUANTIZE[format]
    unpacked = store.layouts[1].views(store.weights(1))
    for name, weight in drawn.items():
        weight = weight.to(dtype)
        if name.endswith(("gate_up_proj", "q_proj.weight", "down_proj.weight")):
            assert torch.equal(unpacked[name], dequantize(quantize(weight))), name
            assert not torch.equal(unpacked[name], weight), f"{name} was not quantized"
        else:  # norms, biases (however shaped) and the router: exact
            assert torch.equal(unpacked[name], weight), name
    assert store.wire(1).dtype == torch.uint8 and store.wire(1).numel() == store.packing(1).nbytes
    assert store.packing(0) is None and store.wire(0).dtype == dtype  # the embedding: raw, in the compute dtype


def test_the_packed_bytes_are_what_the_formats_take_and_the_rest_holds_no_copy():
    store = store_of("nf4", torch.bfloat16, pin=False)
    arenas = store.memory_report().arenas
    assert arenas["packed"] == store.packing(1).nbytes  # (one group: no alignment past its end)
    matrices = 48 * 48 + 4 * 66 * 48 + 48 * 33
    assert store.packing(1).nbytes < 0.55 * matrices + 2 * (48 + 48 + 4 * 48) + 16 * 6  # ~0.52 B/param + raw + pads
    assert arenas["frozen"] >= 2 * 40 * 48 and "grad" in arenas
    assert store.grad_numel(1) == store.state_numel(1) == 0 and store.master_numel(2) == 4 * 48


def test_writing_a_packed_group_again_starts_from_what_it_holds():
    store = store_of("int8", torch.float32, pin=False)
    fill(store, 1, seed=1)
    before = store.weights(1).clone()
    name = "model.layers.0.input_layernorm.weight"
    with store.writing(1) as views:
        views[name].fill_(2.0)
    after = store.layouts[1].views(store.weights(1))
    assert torch.equal(after[name], torch.full((48,), 2.0))
    rest = [n for n in after if n != name]
    assert all(torch.equal(after[n], store.layouts[1].views(before)[n]) for n in rest)


def test_bad_packings_are_refused_in_one_line():
    with pytest.raises(StoreError, match="packed groups"):
        HostStore([GroupLayout.from_specs(LAYER)], torch.float32, packed=frozenset({0}), packed_format="nf4")
    with pytest.raises(StoreError, match="one of"):
        PackedLayout.of(GroupLayout.from_specs(LAYER), "fp4", torch.float32)
    with pytest.raises(StoreError, match="float64"):
        PackedLayout.of(GroupLayout.from_specs(LAYER), "nf4", torch.float64)
    store = store_of("nf4", torch.float32, pin=False)
    with pytest.raises(StoreError, match="weights\\(group\\)"):
        store.master_views(1)


@pytest.mark.gpu
@pytest.mark.parametrize("format", ["nf4", "int8"])
def test_a_group_packed_on_the_gpu_unpacks_there_as_the_format_gives_it(format):
    """`pack_on` a GPU (as a CUDA run's store packs): the bytes come back to pinned host memory, and unpacking them on
    the GPU (as the weight stream does) gives the format's round trip of the weight computed there."""
    device = torch.device("cuda")
    store = store_of(format, torch.bfloat16, pack_on=device)
    drawn = fill(store, 1, seed=2)
    packed = store.wire(1).to(device)
    unpacked = store.layouts[1].views(
        store.packing(1).unpack(packed, torch.empty(store.layouts[1].numel, dtype=torch.bfloat16, device=device))
    )
    quantize, dequantize = QUANTIZE[format]
    for name, weight in drawn.items():
        weight = weight.to(device, torch.bfloat16)
        expected = (
            dequantize(quantize(weight))
            if name.endswith(("gate_up_proj", "q_proj.weight", "down_proj.weight"))
            else weight
        )
        assert torch.equal(unpacked[name], expected), name


def test_the_processes_of_a_host_share_one_packed_arena(tmp_path):
    """With several ranks a host, the packed bytes live in a shared arena as the others do: what one process packs,
    another's store (mapping the same files) unpacks."""
    stores = [
        store_of("nf4", torch.bfloat16, pin=False, shared=SharedArenas(tmp_path / "shm"), shard=(i, 2))
        for i in range(2)
    ]
    drawn = fill(stores[0], 1, seed=3)
    theirs = stores[1].layouts[1].views(stores[1].weights(1))
    ours = stores[0].layouts[1].views(stores[0].weights(1))
    assert all(torch.equal(theirs[name], ours[name]) for name in drawn)
    assert torch.equal(
        theirs["model.layers.0.input_layernorm.weight"], drawn["model.layers.0.input_layernorm.weight"].bfloat16()
    )
    SharedArenas(tmp_path / "shm").unlink()
