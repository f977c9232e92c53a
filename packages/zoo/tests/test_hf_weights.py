from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file

from megatrain_store import GroupLayout, HostStore, StoreError, read_safetensors_header
from megatrain_zoo import PRESETS, build_model, check_hf_weights, load_hf_weights
from megatrain_zoo.hf_weights import WholeGroups, dequantize_mxfp4, entries_as_imported, named_masters


def _store(spec) -> HostStore:
    layouts = [
        GroupLayout.from_specs((p.name, p.shape, p.weight_decay, p.update) for p in g.params) for g in spec.groups
    ]
    return HostStore(layouts, torch.float32, ())


def _checkpoint(spec, directory, generator) -> dict[str, torch.Tensor]:
    tensors = {name: torch.randn(shape, generator=generator) for name, shape in spec.param_shapes().items()}
    save_file(tensors, str(directory / "model.safetensors"))
    return tensors


@pytest.mark.parametrize("name, experts_per_stage", [("tiny-llama", 0), ("tiny-mixtral", 0), ("tiny-mixtral", 2)])
def test_a_checkpoint_loads_into_the_store_by_name(tmp_path, name, experts_per_stage):
    """Every tensor reaches the store under its name, also where a MoE layer's experts are groups of their own."""
    spec = build_model(PRESETS[name], experts_per_stage)
    tensors = _checkpoint(spec, tmp_path, torch.Generator().manual_seed(0))
    store = _store(spec)
    check_hf_weights(spec, tmp_path)
    load_hf_weights(store, spec, tmp_path)
    loaded = named_masters(store)
    assert set(loaded) == set(tensors)
    for key, tensor in tensors.items():
        assert torch.equal(loaded[key], tensor), key
    written = dict(WholeGroups(store).entries())
    assert all(torch.equal(written[key].load(), tensor) for key, tensor in tensors.items())


def test_a_mis_shaped_tensor_is_refused_from_the_headers(tmp_path):
    spec = build_model(PRESETS["tiny-llama"])
    tensors = _checkpoint(spec, tmp_path, torch.Generator().manual_seed(1))
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:, :-1].contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(StoreError, match="lm_head.weight"):
        check_hf_weights(spec, tmp_path)


def test_a_conversion_reads_only_what_an_import_accepts(tmp_path):
    """`entries_as_imported` (convert's and a merge's reading of a directory) refuses, from the headers, a file whose
    tensors are not the model's: a layer more than its config says, as `check_hf_weights` refuses it."""
    model = PRESETS["tiny-llama"]
    _checkpoint(build_model(model), tmp_path, torch.Generator().manual_seed(2))
    fewer = build_model(replace(model, n_layers=model.n_layers - 1))
    files = [tmp_path / "model.safetensors"]
    shapes = {k: tuple(v["shape"]) for k, v in read_safetensors_header(files[0]).items() if k != "__metadata__"}
    with pytest.raises(StoreError, match=f"model.safetensors: unexpected tensor 'model.layers.{model.n_layers - 1}."):
        entries_as_imported(fewer, files, dict.fromkeys(shapes, files[0]), shapes, torch.float32)
    assert len(entries_as_imported(build_model(model), files, dict.fromkeys(shapes, files[0]), shapes, torch.float32))


def test_mxfp4_dequantizes_as_published():
    """Two e2m1 values a byte, low nibble first, times 2^(scale - 127) per 32 of a row; [E, in, out] out."""
    blocks = torch.zeros(1, 2, 1, 16, dtype=torch.uint8)  # one expert, out 2, in 32
    blocks[0, 0, 0, 0] = 0x72  # 1.0 (low nibble), then 6.0
    blocks[0, 1, 0, 15] = 0xA0  # 0.0, then -1.0
    scales = torch.tensor([[[128], [126]]], dtype=torch.uint8)  # x2 and x0.5
    values = dequantize_mxfp4(blocks, scales)
    expected = torch.zeros(1, 32, 2)
    expected[0, 0, 0], expected[0, 1, 0], expected[0, 31, 1] = 2.0, 12.0, -0.5
    assert torch.equal(values, expected)
