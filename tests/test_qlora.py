"""LoRA over a quantized frozen base (QLoRA, model.adapter.base_dtype nf4 or int8) trains exactly like PEFT over the
dequantized base: the store holds each decoder layer's matrices packed (norms, biases, routers, the embedding and the
head in the compute dtype), the engine streams them packed and unpacks them where the layer computes, and the steps
equal PEFT + torch.optim.AdamW on a transformers model whose matrices are the format's dequantized weights (loss,
gradient norm, every adapter, the logits after); the dequantization itself equals the format's (`test_quant.py`
checks that against bitsandbytes, bit for bit). A merged export is that dequantized base plus the adapters."""

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hf_steps import make_trainer
from safetensors.torch import load_file, save_file
from test_dense_families import hf_dense_model
from test_distributed import assert_same_weights
from test_lora import TOLERANCE, R, check_steps, lora_run, peft_model

from megatrain.config import AdapterSection, ConfigError, EngineSection, adapter_of, load_config, model_config_of
from megatrain.export import convert
from megatrain.planning import machine_of, objective_memory
from megatrain_store import Entry, dequantize_int8, dequantize_nf4, quantize_int8, quantize_nf4
from megatrain_store.packed import quantizes
from megatrain_zoo import ZooError, build_model, hf_weights

ROUND_TRIP = {"nf4": (quantize_nf4, dequantize_nf4), "int8": (quantize_int8, dequantize_int8)}


def dequantized(name: str, weight: torch.Tensor, base_dtype: str, compute: torch.dtype, device) -> torch.Tensor:
    """What the store streams for checkpoint tensor `name` of a decoder layer: its format's round trip of the weight
    in the compute dtype where the store packs it (on `device`, where the trainer quantizes), the weight as it is
    elsewhere."""
    if not name.startswith("model.layers.") or not quantizes(Entry(name, tuple(weight.shape), 0, True)):
        return weight.to(compute)
    quantize, dequantize = ROUND_TRIP[base_dtype]
    return dequantize(quantize(weight.to(device, compute))).cpu()


def quantized_run(
    tmp_path, name, base_dtype, dtype="float32", device="cpu", steps=3, implementation="auto", engine=EngineSection()
):
    """(megatrain's LoRA trainer over the nf4/int8 base of a fresh tiny model of preset `name`, train section, PEFT
    over the same base dequantized, in fp32), after checking that the store holds the layers packed (each group of
    their base: a MoE layer's in parts too) and streams each tensor as `dequantized` gives it."""
    reference = hf_dense_model(name, int(torch.randint(0, 2**31 - 1, ()).item()))
    reference.save_pretrained(tmp_path / "hf")
    compute = getattr(torch, dtype)
    adapter = AdapterSection(type="lora", r=R, alpha=8.0, base_dtype=base_dtype)
    trainer, train = make_trainer(
        tmp_path / "hf", tmp_path, 0.05, steps, device=device, precision=dtype, adam_eps=1e-6, adapter=adapter,
        implementation=implementation, engine=engine,
    )  # fmt: skip
    store, spec = trainer.store, trainer.spec
    assert store.arenas["packed"].dtype == torch.uint8 and set(store.packed.layouts) == spec.packed_groups
    layers = {g for g, group in enumerate(spec.groups) if group.name.startswith("layer")} - spec.adapter_groups
    assert spec.packed_groups == layers  # (each layer's base; not the embedding, head)
    streamed = {name: tensor.cpu() for name, tensor in trainer.streamed_weights().items()}
    fused = spec.fused_checkpoint_names()  # transformers' expert tensors: the store's per-expert ones back to back
    with torch.no_grad():
        for param_name, param in reference.named_parameters():
            flat, start = param.detach().reshape(-1).clone(), 0
            for part in fused[param_name][1] if param_name in fused else (param_name,):
                numel, shape = streamed[part].numel(), streamed[part].shape
                expected = dequantized(part, flat[start : start + numel].view(shape), base_dtype, compute, device)
                assert torch.equal(streamed[part], expected), part
                flat[start : start + numel] = expected.reshape(-1).float()
                start += numel
            param.copy_(flat.view(param.shape))
    return trainer, train, peft_model(reference.float(), ["all-linear"])


@pytest.mark.parametrize("base_dtype", ["nf4", "int8"])
def test_steps_over_a_quantized_base_match_peft_over_it_dequantized(base_dtype, tmp_path):
    trainer, train, model = quantized_run(tmp_path, "tiny-qwen2", base_dtype)
    check_steps(trainer, train, model, 0.05, 0, False, TOLERANCE[torch.float32])
    trainer.close()


@pytest.mark.parametrize("experts_per_stage", ["auto", 3])
def test_a_mixture_of_experts_over_an_nf4_base_matches_peft(experts_per_stage, tmp_path):
    """Each expert's matrices packed apart, the router and the shared expert's gate kept exact; whole layers, or
    their experts streamed in parts of 3 (each part's group packed, the layer's adapters bound by every stage)."""
    engine = EngineSection(experts_per_stage=experts_per_stage)
    trainer, train, model = quantized_run(tmp_path, "tiny-qwen2-moe", "nf4", engine=engine)
    assert bool(trainer.spec.expert_parts) == (experts_per_stage == 3)
    check_steps(trainer, train, model, 0.05, 1, False, TOLERANCE[torch.float32])
    trainer.close()


def test_the_generic_path_over_an_nf4_base_matches_peft(tmp_path):
    """transformers' own layers (model.implementation: transformers) bind the slot's unpacked weights as any other."""
    trainer, train, model = quantized_run(tmp_path, "tiny-qwen2", "nf4", implementation="transformers")
    check_steps(trainer, train, model, 0.05, 3, False, TOLERANCE[torch.float32])
    trainer.close()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_steps_over_an_nf4_base_match_peft(dtype, tmp_path):
    """The CUDA engine copies each layer's packed bytes through its byte ring and unpacks them on the cast stream."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    trainer, train, model = quantized_run(tmp_path, "tiny-qwen2", "nf4", dtype, "cuda", steps=4)
    tolerances = TOLERANCE[getattr(torch, dtype)]
    check_steps(trainer, train, model.to(torch.float32), 0.05, 2, False, tolerances)
    assert trainer.pipeline.weights._packed is not None  # (the packed ring served the copies)
    trainer.close()


def test_a_merged_export_is_the_dequantized_base_plus_the_adapters(tmp_path, capsys):
    trainer, _, _ = quantized_run(tmp_path, "tiny-qwen2", "nf4", steps=1)
    out = trainer.export(tmp_path / "run" / "final")  # (a run's final/: its config.json beside says how it trained)
    (tmp_path / "run" / "config.json").write_text(json.dumps(trainer.config.as_dict()))
    streamed = trainer.streamed_weights()
    scale = trainer.spec.adapter.scale
    # the packed base the run kept: its very bytes, nothing quantized again; then without it: quantized again
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("megatrain_store.packed._QUANTIZE", {})  # any quantizing raises KeyError
        merged = convert(out, tmp_path / "merged", merge=True)
    assert "reads the packed base the run kept" in capsys.readouterr().err
    (tmp_path / "run" / "cache" / "packed-base.safetensors").unlink()
    requantized = convert(out, tmp_path / "requantized", merge=True)
    assert "dequantized from its nf4" in capsys.readouterr().err
    for directory in (merged, requantized):
        weights = load_file(directory / "model.safetensors")
        for name, value in weights.items():
            down = streamed.get(name.removesuffix(".weight") + ".lora_A.weight")
            expected = streamed[name].float()
            if down is not None:
                expected = expected + scale * streamed[name.removesuffix(".weight") + ".lora_B.weight"].float() @ down
            assert torch.allclose(value.float(), expected, rtol=1e-6, atol=1e-7), name
    trainer.close()


def test_a_packed_base_needs_a_float_compute_dtype_and_a_known_format(tmp_path):
    with pytest.raises(ConfigError, match="base_dtype must be one of"):
        AdapterSection(type="lora", base_dtype="fp4")
    with pytest.raises(ConfigError, match="not float64"):
        config = load_config(
            None,
            [
                "model.preset=tiny-qwen2",
                "model.adapter.type=lora",
                "model.adapter.base_dtype=nf4",
                "precision.compute_dtype=float64",
                "device=cpu",
            ],
        )
        adapter_of(config)


def test_a_run_over_an_nf4_base_resumes_as_one_that_never_stopped(tmp_path):
    """The checkpoint holds the adapters and their moments; a resumed run packs its base again, to the same bytes."""
    np.save(tmp_path / "tokens.npy", np.random.default_rng().integers(0, 256, 40 * 16).astype(np.int32))
    rows, adapters = lora_run(tmp_path, "whole", 1, steps=4, base_dtype="nf4")
    lora_run(tmp_path, "part", 1, steps=2, base_dtype="nf4", save_every=2)
    resumed, resumed_adapters = lora_run(tmp_path, "part", 1, steps=4, resume=True, base_dtype="nf4")
    assert [row["step"] for row in resumed] == [1, 2, 3, 4]
    for a, b in zip(rows, resumed):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    assert_same_weights(adapters, resumed_adapters)


def test_a_packed_base_is_kept_beside_the_run_and_read_back_instead_of_quantized(tmp_path, monkeypatch, capsys):
    """The first run keeps its packed base in output_dir/cache; the next (a resume, an eval) reads those bytes and
    quantizes nothing; a changed checkpoint or a torn file is quantized again and kept anew."""
    first, _, _ = quantized_run(tmp_path, "tiny-qwen2", "nf4")
    packed = first.store.arenas["packed"].clone()
    first.close()
    cache = tmp_path / "run" / "cache" / "packed-base.safetensors"
    assert cache.exists() and "kept the packed base in" in capsys.readouterr().err

    def again(fails_if_quantized: bool):
        if fails_if_quantized:
            monkeypatch.setattr("megatrain_store.packed._QUANTIZE", {})  # any quantizing raises KeyError
        adapter = AdapterSection(type="lora", r=R, alpha=8.0, base_dtype="nf4")
        trainer, _ = make_trainer(tmp_path / "hf", tmp_path, 0.05, 3, adapter=adapter)
        monkeypatch.undo()
        arena = trainer.store.arenas["packed"].clone()
        trainer.close()
        return arena

    assert torch.equal(again(fails_if_quantized=True), packed)
    assert "read the packed base from" in capsys.readouterr().err

    weights = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(weights)
    name = next(n for n in tensors if n.endswith("layers.0.mlp.up_proj.weight"))
    tensors[name] = tensors[name] * 2
    save_file(tensors, weights, metadata={"format": "pt"})
    changed = again(fails_if_quantized=False)
    assert not torch.equal(changed, packed) and "kept the packed base in" in capsys.readouterr().err
    assert torch.equal(again(fails_if_quantized=True), changed)

    cache.write_bytes(cache.read_bytes()[: cache.stat().st_size // 2])
    assert torch.equal(again(fails_if_quantized=False), changed)
    assert "kept the packed base in" in capsys.readouterr().err

    cache.unlink()  # a disk without room for it twice over keeps its room for the checkpoints
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("megatrain_zoo.hf_weights.shutil.disk_usage", lambda path: SimpleNamespace(free=0))
        assert torch.equal(again(fails_if_quantized=False), changed)
    assert not cache.exists() and "not keeping the packed base in" in capsys.readouterr().err


def bitsandbytes_checkpoint(directory, seed: int) -> dict:
    """A fresh tiny Qwen2 saved as transformers saves a QLoRA base (bitsandbytes' Linear4bit: NF4, double
    quantization, `QuantState.as_dict(packed=True)` beside each layer matrix, quantization_config in config.json);
    each such matrix's bitsandbytes dequantization in float32, by name."""
    import bitsandbytes.functional as bnb

    hf_dense_model("tiny-qwen2", seed).to(torch.bfloat16).save_pretrained(directory)
    tensors, dequantized = load_file(directory / "model.safetensors"), {}
    for name in [n for n in tensors if n.startswith("model.layers.") and n.endswith("proj.weight")]:
        packed, state = bnb.quantize_4bit(tensors[name], blocksize=64, compress_statistics=True, quant_type="nf4")
        tensors |= {name: packed} | {f"{name}.{key}": value for key, value in state.as_dict(packed=True).items()}
        # (flat: bitsandbytes' CPU kernel misreads a 2-D weight whose rows are not whole blocks; test_quant.py)
        flat = bnb.QuantState(
            state.absmax, torch.Size([state.shape.numel()]), state.code, 64, "nf4", torch.float32, state.offset,
            state.state2,
        )  # fmt: skip
        with torch.compiler.set_stance("force_eager"):
            dequantized[name] = bnb.dequantize_4bit(packed, flat).view(state.shape)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16",
    }  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    return dequantized


def test_a_bitsandbytes_qlora_checkpoint_is_read_as_it_is(tmp_path, capsys, monkeypatch):
    """A QLoRA base published pre-quantized (transformers + bitsandbytes, as the "-bnb-4bit" models are): over an nf4
    base the run streams bitsandbytes' own dequantization bit for bit (its bytes taken as they are, not quantized
    again), full training starts from the same weights in its fp32 masters, and the other tensors are the file's."""
    dequantized = bitsandbytes_checkpoint(tmp_path / "hf", seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    plain = load_file(tmp_path / "hf" / "model.safetensors")
    adapter_nf4 = AdapterSection(type="lora", r=R, alpha=8.0, base_dtype="nf4")
    dequantized_on_load = []
    real = hf_weights.dequantize_nf4
    monkeypatch.setattr(
        hf_weights, "dequantize_nf4", lambda q, *a, **k: dequantized_on_load.append(q) or real(q, *a, **k)
    )
    for adapter in (adapter_nf4, AdapterSection()):
        trainer, _ = make_trainer(tmp_path / "hf", tmp_path / (adapter.type or "full"), 0.05, 1, adapter=adapter)
        # over an nf4 base each NF4 weight is read once, as bytes, never dequantized on the host; in full training,
        # dequantized into the masters
        assert len(dequantized_on_load) == (0 if adapter is adapter_nf4 else len(dequantized))
        streamed = {name: tensor.float() for name, tensor in trainer.streamed_weights().items()}
        trainer.close()
        for name, weight in dequantized.items():
            assert torch.equal(streamed[name], weight), name
        for name in streamed.keys() & plain.keys() - dequantized.keys():
            assert torch.equal(streamed[name], plain[name].float()), name
    err = capsys.readouterr().err
    assert "reading 14 NF4 tensors into the packed base as they are" in err
    assert "reading 14 NF4 tensors dequantized" in err
    with pytest.raises(ZooError, match="bitsandbytes NF4 weights, which megatrain's own templates read"):
        make_trainer(tmp_path / "hf", tmp_path / "generic", 0.05, 1, implementation="transformers")
    # `megatrain convert` of the directory: the same weights, written dequantized
    written = load_file(convert(tmp_path / "hf", tmp_path / "converted", dtype="float32") / "model.safetensors")
    assert written.keys() == streamed.keys()  # (each code's statistics gone with it)
    assert all(torch.equal(written[name], weight) for name, weight in dequantized.items())
    assert all(torch.equal(written[name], plain[name].float()) for name in written.keys() - dequantized.keys())
    # a damaged file, its bytes taken as they are: refused by its scales, naming the tensor
    name = next(iter(dequantized))
    plain[f"{name}.nested_absmax"][0] = float("nan")
    save_file(plain, tmp_path / "hf" / "model.safetensors")
    with pytest.raises(ZooError, match=f"tensor {re.escape(name)} in .* holds NaN or Inf"):
        make_trainer(tmp_path / "hf", tmp_path / "damaged", 0.05, 1, adapter=adapter_nf4)


def test_generation_over_a_packed_base_is_planned_with_its_merged_copies():
    """GRPO's generation merges the adapters on the host (`with_adapters_merged`): a copy of each adapted matrix, and
    the packed layers unpacked first; the planner counts both, so a base the host cannot hold unpacked is refused
    before it loads, not killed while it generates."""
    overrides = ["model.preset=tiny-qwen2", "model.adapter.type=lora", "train.objective=grpo", "device=cpu"]
    memory = {}
    for base_dtype in ("null", "nf4"):
        config = load_config(None, [*overrides, f"model.adapter.base_dtype={base_dtype}"])
        spec = build_model(model_config_of(config), 0, adapter_of(config))
        memory[base_dtype] = objective_memory(config, spec, machine_of(config), torch.float32).generation_host_bytes
        adapted = sum(
            p.numel
            for g in spec.frozen_groups(set())
            for p in spec.groups[g].params
            if ".layers." in p.name and p.name.endswith("proj.weight")
        )
        layers = sum(p.numel for g in spec.packed_groups for p in spec.groups[g].params)
    assert memory["null"] == 4 * adapted  # (all-linear: every projection of every layer)
    assert memory["nf4"] == 4 * (adapted + layers)


def test_a_gpu_runs_packed_base_is_read_on_a_machine_without_one():
    """`megatrain convert` and `eval` read a CUDA run's config (device: cuda) wherever they run: its base format
    comes from the config, not from the GPUs this machine has."""
    overrides = ["model.preset=tiny-qwen2", "model.adapter.type=lora", "model.adapter.base_dtype=nf4", "device=cuda"]
    assert adapter_of(load_config(None, overrides)).base_format == "nf4"
    held = load_config(None, [*overrides[:2], "model.adapter.base_dtype=bfloat16", "device=cuda"])
    assert adapter_of(held).base_format is None  # (auto on a GPU: bf16, the base's dtype as named)
