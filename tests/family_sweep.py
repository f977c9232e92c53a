"""Does megatrain train every transformers causal LM exactly like transformers + torch AdamW? A sweep over
transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES: for each decoder family, a tiny model made from its config class's
defaults (shrunk by known attribute names, tests/test_generic.py's FAMILIES where it has one), trained three steps
by megatrain (implementation auto: a native template where there is one) and by transformers + AdamW, as
`check_trains_like_transformers` does, each family in a process of its own under a timeout.

    python tests/family_sweep.py [--families a,b] [--out PATH] [--timeout S] [--jobs N]

Not collected by pytest (its name does not start with test_). Outcomes: exact, mismatch (which check, the numbers),
refused (megatrain's own error before training), crashed (any other exception: the innermost megatrain frame),
config (transformers itself could not build or run the tiny model), timeout, not a decoder.
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
PACKAGES = str(REPO / "packages")
DEFAULT_OUT = REPO / "benchmarks" / "results" / "generic-family-sweep-cpu.json"
SEQ, VOCAB = 12, 256  # (generic_trainer's data.seq_len; random_batch's vocabulary)

# --- the tiny config ---------------------------------------------------------------------------------------------

# attribute -> tiny value, set wherever a config's defaults have the attribute (and it is not None)
SIZES = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "dim"), 64),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_blocks"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "multi_query_group_num", "n_kv_heads", "num_kv_heads"), 2),
    **dict.fromkeys(("head_dim", "kv_channels", "attention_head_dim", "v_head_dim", "d_head", "linear_head_dim"), 16),
    **dict.fromkeys(("rotary_dim",), 8),  # (GPT-J's and CodeGen's rotary part of a 16-wide head)
    # an image or audio tower's widths into and out of its adapter: every width is 64 here
    **dict.fromkeys(("adapter_in_dim", "adapter_out_dim", "adapter_input_size", "out_hidden_size"), 64),
    **dict.fromkeys(("downsample_hidden_size",), 32),
    **dict.fromkeys(
        ("index_head_dim", "indexer_head_dim"), 16
    ),  # (Zamba's attention over [hidden, embeddings]: twice hidden_size)
    **dict.fromkeys(("intermediate_size", "ffn_dim", "d_ff", "ffn_hidden_size", "n_inner", "block_ff_dim"), 128),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"), 32),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "moe_top_k"), 2),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"), 1),
    **dict.fromkeys(("n_group", "topk_group", "num_expert_group"), 1),  # (expert groups: 4 experts make one)
    **dict.fromkeys(("expert_ffn_hidden_size",), 32),
    "zero_expert_num": 2,  # (LongCat-Flash's identity experts)
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len"), 256),
    **dict.fromkeys(
        ("sliding_window", "attention_window_size", "window_size", "sliding_window_size"), 4
    ),  # (shorter than SEQ)
    **dict.fromkeys(("vocab_size", "unpadded_vocab_size"), VOCAB),
    "first_k_dense_replace": 1,  # (layer 0 dense, layer 1 experts: both kinds present)
    **dict.fromkeys(("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim"), 16),  # (DeepSeek's rotary: head_dim)
    # Gemma 3n's and Gemma 4's per-layer embeddings
    "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 16,
    "q_lora_rank": 32,
    # Mamba, Mamba-2 and linear attention: a few small heads, short chunks (several chunks in SEQ)
    **dict.fromkeys(("mamba_d_state", "state_size", "ssm_state_size", "mamba_d_conv"), 16),
    **dict.fromkeys(("mamba_n_heads", "mamba_d_head", "mamba_dt_rank", "n_mamba_heads"), 8),
    **dict.fromkeys(("mamba_chunk_size", "chunk_size"), 4),
    **dict.fromkeys(("linear_key_head_dim", "linear_value_head_dim"), 16),
    **dict.fromkeys(("linear_num_key_heads",), 2),
    **dict.fromkeys(("linear_num_value_heads",), 4),
    "output_router_logits": False,  # (refused on purpose by the generic path: docs/guide.md)
}
# attributes set even where the defaults leave them None (None there means "derive it", and a tiny model's own
# derivation may differ: Ministral's head_dim None fails in its attention)
SET_WHERE_NONE = ("head_dim",)
SPECIAL_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

# model_type -> fields over the shrunk defaults, where the generic shrink alone builds no tiny model (why, each)
OVERRIDES: dict[str, dict] = {
    # MoE fields the defaults leave None (a published config sets them)
    "deepseek_v2": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1),
    "dots1": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1),
    # the defaults' layer_types hold no attention layer in the layers kept: Mamba and attention both
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),
    # Mamba-2's heads must cover expand * hidden_size: 8 heads of 16
    "mamba2": dict(num_heads=8, head_dim=16, expand=2, n_groups=1),
    # ZAYA takes one expert per token only
    "zaya": dict(num_experts_per_tok=1),
    # index layers and key/value sources name layers by index: one sliding and one indexed layer
    "kolibri1_1": dict(
        num_hidden_layers=2,
        layer_types=["sliding_attention", "indexed_attention"],
        index_layers=[1],
        kv_source_layers=[0, 1],
        mlp_only_layers=[0],
        index_topk=4,
        index_pool_size=64,
        index_compression=2,
        index_num_heads=2,
        index_num_local_tokens=2,
        index_num_sink_tokens=1,
    ),
    # Zamba's shared attention block needs two hybrid layers to tie (one alone fails transformers' tying);
    # its attention runs over [hidden, embeddings]: heads of 128 / 4
    "zamba": dict(
        num_hidden_layers=4,
        attn_layer_period=2,
        attn_layer_offset=1,
        layers_block_type=["linear_attention", "hybrid"] * 2,
        attention_head_dim=32,
    ),
    "zamba2": dict(
        layers_block_type=["linear_attention", "hybrid"], hybrid_layer_ids=[1], mamba_headdim=16, attention_head_dim=32
    ),
    # its indexer's sizes have no defaults (None): transformers' own defaults cannot build it
    **dict.fromkeys(
        ("qwen4_exp_text",),
        dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=2),
    ),
    # the defaults' rope_parameters is {} where the model reads one per layer type (the defaults fail too)
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    # (its chunked torch kernel fails with queries narrower than values: qk_dim_factor 0.5 -> 1; its backward
    # in transformers then fails on an in-place update all the same: "config")
    "xlstm": dict(qk_dim_factor=1.0),
    # the input, recurrent (looped) and output sections must add up to the layers: two each, attention and MLP
    "dory": dict(
        num_hidden_layers=6,
        layer_types=["sliding_attention", "mlp", "full_attention", "mlp", "sliding_attention", "mlp"],
        n_input_layers=2,
        n_recurrent_layers=2,
        n_output_layers=2,
    ),
    # one layer per stack (its high- and low-level stacks): 16 per stack index past the layers kept
    # (its cache has num_layers_per_stack * H_cycles * (L_cycles + 1) layers: one cycle of each, one layer a stack)
    "hrm_text": dict(num_hidden_layers=2, num_layers_per_stack=1, H_cycles=1, L_cycles=1, L_bp_cycles=[1]),
    # its sliding layers' head_dim must be the latent query head's (no-rotary 16 + rotary 16)
    "dots3_note_text": dict(head_dim=32),
}

# bert-likes whose causal LM is their encoder run with a causal mask (is_decoder=True): not decoder families
ENCODERS_WITH_A_DECODER_MODE = {"bert-generation"}


def not_a_decoder(model_type: str, config) -> str | None:
    """Why `model_type` is no decoder-only family (None: it is one)."""
    from transformers.models.auto import modeling_auto

    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder (config.is_encoder_decoder)"
    if model_type in getattr(modeling_auto, "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", {}):
        return "a sequence-to-sequence model"
    if model_type in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES or model_type in ENCODERS_WITH_A_DECODER_MODE:
        return "an encoder (masked LM) with a decoder mode"
    return None


def tiny_config(model_type: str) -> dict:
    """The tiny config.json of a family: test_generic's or test_image_text's where they have one, else its defaults
    shrunk."""
    import test_generic

    if model_type in test_generic.FAMILIES:
        return test_generic.tiny_hf_config(model_type)
    if model_type == "gemma3n_text":  # (per-layer inputs, refused on purpose by megatrain: test_generic's tiny one)
        return {**test_generic.COMMON, "model_type": model_type, **test_generic.GEMMA3N_TEXT}
    import test_image_text

    if model_type in test_image_text.FAMILIES:  # (an image-text family's tested tiny config)
        return {"model_type": model_type, **test_image_text.FAMILIES[model_type]}
    import transformers

    defaults = transformers.CONFIG_MAPPING[model_type]().to_dict()
    tiny = {**shrink(defaults), **OVERRIDES.get(model_type, {}), "model_type": model_type}
    text = tiny.get("text_config")
    if isinstance(text, dict) and text.get("model_type") in OVERRIDES:  # (a composite's text model: its own fixes)
        tiny["text_config"] = {**text, **OVERRIDES[text["model_type"]]}
    return tiny


def shrink(config: dict) -> dict:
    """A config dict (or a sub-config's) with its sizes tiny, per-layer lists cut to the layers kept, token ids
    inside the tiny vocabulary and dropout off."""
    out = dict(config)
    for key, value in config.items():
        if isinstance(value, dict) and ("model_type" in value or set(value) & set(SIZES)):  # (a sub-config)
            out[key] = shrink(value)
        elif key in SIZES and (value or key in SET_WHERE_NONE) and not isinstance(value, bool):  # (0, None: off)
            out[key] = SIZES[key] if not isinstance(value, list) else [SIZES[key]] * len(value)
        elif ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            out[key] = 0.0
    out.update(_token_ids(config))
    out.update(_widths_as_hidden(config, out))
    return _derived_sizes(_keep_layers(config, out))


# widths the defaults give as a multiple of hidden_size (Zamba's attention over [hidden, embeddings]: twice it;
# OPT's embedding projection, xLSTM's embedding, RWKV's attention: equal to it): kept in that ratio
WIDTHS_OF_HIDDEN = ("attention_hidden_size", "word_embed_proj_dim", "embedding_dim")


def _widths_as_hidden(config: dict, out: dict) -> dict:
    hidden = config.get("hidden_size")
    if not isinstance(hidden, int) or not hidden:
        return {}
    return {
        key: config[key] * out["hidden_size"] // hidden
        for key in WIDTHS_OF_HIDDEN
        if isinstance(config.get(key), int) and config[key] % hidden == 0
    }


def _derived_sizes(out: dict) -> dict:
    """Sizes that must agree with the shrunk ones: latent attention's key heads (one per query head), the query
    head width of latent attention (its no-rotary part + rotary part), Mamba's heads covering expand * hidden."""
    if "kv_lora_rank" in out and "num_attention_heads" in out and "num_key_value_heads" in out:
        out["num_key_value_heads"] = out["num_attention_heads"]
    if out.get("qk_head_dim") is not None and "qk_nope_head_dim" in out:
        out["qk_head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    if {"mamba_n_heads", "mamba_d_head"} <= set(out) and "hidden_size" in out:
        out["mamba_d_head"] = out.get("mamba_expand", 2) * out["hidden_size"] // out["mamba_n_heads"]
    return out


def _token_ids(config: dict) -> dict:
    """Token ids inside the tiny vocabulary: pad/bos/eos 0/1/2, the others (image, audio, ...) from 200 up."""
    ids, spare = {}, iter(range(200, VOCAB))
    for key, value in config.items():
        if not (key.endswith("_token_id") or key.endswith("_token_index") or key.endswith("_token_ids")):
            continue
        small = SPECIAL_IDS.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= VOCAB:
            ids[key] = small if small is not None else next(spare)
        elif isinstance(value, list) and any(isinstance(v, int) and v >= VOCAB for v in value):
            ids[key] = [small if small is not None and i == 0 else next(spare) for i, _ in enumerate(value)]
    return ids


LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")


def _keep_layers(config: dict, out: dict) -> dict:
    """Cut every per-layer list (a list as long as the default layer count: layer_types, mlp_layer_types, ...) to
    the first layer of each kind (each distinct combination of their values), 2 to 4 layers, so that every kind of
    layer a hybrid has is trained; the layer count set to match."""
    key = next((k for k in LAYER_COUNT_KEYS if isinstance(config.get(k), int)), None)
    if key is None:
        return out
    n = config[key]
    lists = [k for k, v in config.items() if isinstance(v, list) and len(v) == n and n > 1]
    per_layer = _by_index(config["per_layer_config"]) if isinstance(config.get("per_layer_config"), dict) else {}
    kinds = [tuple(json.dumps(config[k][i]) for k in lists) + (json.dumps(per_layer.get(i)),) for i in range(n)]
    chosen = [i for i in range(n) if kinds[i] not in kinds[:i]][:4]  # (first of each kind; at most 4)
    chosen += [i for i in range(n) if i not in chosen][: max(0, 2 - len(chosen))]
    chosen.sort()
    for k in lists:
        out[k] = [out[k][i] for i in chosen]
    out[key] = len(chosen)
    if config.get("num_kv_shared_layers") == n:  # (an assistant reusing every layer's cache of its target model)
        out["num_kv_shared_layers"] = len(chosen)
    if per_layer:  # (Gemma 4's, dots3's overrides by layer index, renumbered)
        width = len(next(iter(config["per_layer_config"])))
        out["per_layer_config"] = {
            str(new).zfill(width): shrink(per_layer[old]) for new, old in enumerate(chosen) if old in per_layer
        }
    return out


def _by_index(per_layer: dict) -> dict:
    return {int(k): v for k, v in per_layer.items()}


# --- one family, in a process of its own -------------------------------------------------------------------------


class Outcome(Exception):
    """A family's outcome other than exact, raised where it is known."""

    def __init__(self, outcome: str, detail: dict):
        super().__init__(outcome)
        self.outcome, self.detail = outcome, detail


def composite(hf: dict) -> bool:
    """An image-text (or audio) config: megatrain trains it whole through transformers' modules."""
    return any(hf.get(k) for k in ("vision_config", "audio_config", "vq_config"))  # (Gemma 4's are null: text only)


def reference_model(hf: dict, seed: int):
    """transformers' tiny model with test_generic's random weights; one forward and backward run on it, so that a
    model transformers cannot train is the sweep's "config", not megatrain's failure."""
    import test_generic
    import torch

    model = test_generic.hf_model(hf, seed)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    return model


def megatrain_frame(error: BaseException) -> str | None:
    """file:line of the innermost frame in megatrain's packages, over the exception and its causes."""
    found = None
    while error is not None:
        for frame in traceback.extract_tb(error.__traceback__):
            if frame.filename.startswith(PACKAGES):
                found = f"{os.path.relpath(frame.filename, REPO)}:{frame.lineno} ({frame.name})"
        error = error.__cause__ or error.__context__
    return found


def innermost_frame(error: BaseException) -> str:
    """file:line of the innermost frame of the innermost cause (often transformers' modeling file)."""
    while (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    frames = traceback.extract_tb(error.__traceback__)
    return f"{frames[-1].filename.rsplit('/site-packages/', 1)[-1]}:{frames[-1].lineno}" if frames else "?"


def error_detail(error: BaseException) -> dict:
    first = (str(error).strip().splitlines() or [""])[0][:400]
    return {
        "type": type(error).__name__,
        "message": first,
        "megatrain_frame": megatrain_frame(error),
        "innermost_frame": innermost_frame(error),
    }


def megatrains_own(error: BaseException) -> bool:
    """An error of megatrain's own classes (ZooError, GenericError, ConfigError, ...): a refusal."""
    return type(error).__module__.split(".")[0].startswith("megatrain")


def stage(outcome: str, what: str, call):
    """`call()`, its exception raised as `outcome` (config: transformers' failure; crashed: megatrain's, unless
    megatrain refused it in its own words before training)."""
    try:
        return call()
    except Outcome:
        raise
    except Exception as error:  # noqa: BLE001 (whatever a family's modules raise)
        kind = "refused" if outcome == "crashed" and what == "trainer" and megatrains_own(error) else outcome
        raise Outcome(kind, {"stage": what, **error_detail(error)}) from error


def make_trainer(hf: dict, tmp: Path, grad_clip: float):
    """test_generic.generic_trainer's run (3 steps of 6 rows, micro-batches of 2, fp32, clipped), implementation
    auto; an image-text config trained whole (its text model alone would not match transformers' whole model)."""
    import test_generic

    return test_generic.generic_trainer(tmp / "hf", tmp, grad_clip, image_text=composite(hf) or "auto")


def stored_count(reference) -> int:
    """The elements megatrain stores for transformers' model: its parameters, and a router's correction bias (moved
    only by load; a buffer in most families, a parameter in ERNIE 4.5's) twice, as megatrain keeps it in two tensors
    (`split_precision_names`: hi + lo)."""
    import test_generic

    biases = {n: t for n, t in test_generic.persistent_buffers(reference).items() if n.endswith("correction_bias")}
    tensors = {**biases, **dict(reference.named_parameters())}
    return sum(t.numel() * (2 if name.endswith("correction_bias") else 1) for name, t in tensors.items())


def check_family(hf: dict, tmp: Path, grad_clip: float, seed: int) -> dict:
    """test_generic.check_trains_like_transformers on a config dict, any path (native or transformers), each
    check recorded instead of asserted: {"path", "failed": [...], "steps": [...], ...}."""
    import test_generic
    import torch
    from hf_steps import random_batch

    reference = stage("config", "transformers model", lambda: reference_model(hf, seed))
    stage("config", "save_pretrained", lambda: reference.save_pretrained(tmp / "hf"))
    trainer = stage("crashed", "trainer", lambda: make_trainer(hf, tmp, grad_clip))
    model_config = trainer.model_config
    report = {"path": model_config.implementation + (" (whole image-text)" if model_config.image_text else "")}
    failed = report["failed"] = []
    theirs = stored_count(reference)
    if model_config.n_params != theirs:
        failed.append({"check": "n_params", "ours": model_config.n_params, "theirs": theirs})
    optimizer = test_generic.adamw_decaying_matrices(reference, trainer.config.train)
    generator = torch.Generator().manual_seed(seed)
    noise_only, report["steps"] = {}, []
    for step in range(trainer.config.train.steps):
        ids, labels = random_batch(6, SEQ, VOCAB, generator)
        metrics = stage("crashed", f"train_step {step}", lambda: trainer.train_step(_batch(ids, labels)))
        _, loss, norm = stage(
            "config",
            f"reference step {step}",
            lambda: _reference_step(hf, reference, optimizer, trainer, step, ids, labels),
        )
        report["steps"].append({"loss": [metrics.loss, loss.item()], "grad_norm": [metrics.grad_norm, norm.item()]})
        _compare(failed, f"loss step {step}", metrics.loss, loss.item(), 1e-5)
        _compare(failed, f"grad_norm step {step}", metrics.grad_norm, norm.item(), 1e-4)
        for name, p in reference.named_parameters():  # (zero in exact arithmetic: fp32 noise AdamW scales up)
            grad = p.grad if p.grad is not None else torch.zeros_like(p)  # (a parameter the forward never uses)
            noise_only[name] = noise_only.get(name, False) | (grad.abs() < 1e-7 * norm)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    our_logits = stage("crashed", "logits", lambda: trainer.logits(ids).cpu())
    exported = stage("crashed", "export", lambda: trainer.export(tmp / "out"))
    trainer.close()
    reloaded = stage("crashed", "reload of the export in transformers", lambda: _reload(exported))
    _compare_exports(failed, reference, reloaded, noise_only, our_logits, ids)
    return report


# causal LMs whose loss takes labels already shifted (TrOCR's decoder: `labels[..., i]` is the target of
# `logits[..., i]`): their reference is given megatrain's labels (the next token at each position) as they are
LABELS_NOT_SHIFTED = {"trocr"}


def _reference_step(hf: dict, reference, optimizer, trainer, step: int, ids, labels):
    import hf_steps

    shift = hf_steps.hf_labels
    if hf["model_type"] in LABELS_NOT_SHIFTED:
        hf_steps.hf_labels = lambda labels: labels
    try:
        train = trainer.config.train
        return hf_steps.reference_step(reference, optimizer, train, step, train.grad_clip, input_ids=ids, labels=labels)
    finally:
        hf_steps.hf_labels = shift


def _batch(ids, labels):
    from megatrain.step import StepBatch

    return StepBatch(ids, labels)


def _reload(exported):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()


def _compare(failed: list, check: str, ours: float, theirs: float, rel: float) -> None:
    """test_generic's pytest.approx(theirs, rel) of a scalar, recorded where it fails."""
    error = abs(ours - theirs) / max(abs(theirs), 1e-12)
    if not error <= rel:  # (NaN fails too)
        failed.append({"check": check, "ours": ours, "theirs": theirs, "rel_err": error, "tolerance": rel})


def _compare_exports(failed: list, reference, reloaded, noise_only: dict, our_logits, ids) -> None:
    """The exported weights (where their gradient was signal), persistent buffers and logits, as the test checks
    them; the worst weight recorded, not only the first over its tolerance."""
    import test_generic
    import torch
    from hf_steps import rel_err

    ours = dict(reloaded.named_parameters())
    worst = (0.0, None)
    for name, param in reference.named_parameters():
        if name not in ours:
            failed.append({"check": f"weights: {name} not in the export"})
            continue
        signal = ~noise_only[name]
        worst = max(worst, (rel_err(ours[name].detach()[signal], param.detach()[signal]), name), key=lambda w: w[0])
    if worst[0] >= 1e-4:
        failed.append({"check": f"weights: {worst[1]} (the worst)", "rel_err": worst[0], "tolerance": 1e-4})
    reloaded_buffers = test_generic.persistent_buffers(reloaded)
    for name, buffer in test_generic.persistent_buffers(reference).items():
        if name not in reloaded_buffers or not torch.equal(reloaded_buffers[name].to(buffer.dtype), buffer):
            failed.append({"check": f"buffer {name}"})
    with torch.no_grad():
        for what, logits, tolerance in (
            ("reloaded", reloaded(ids).logits, 1e-5),
            ("reference", reference(ids).logits, 1e-4),
        ):
            error = rel_err(our_logits, logits)
            if not error < tolerance:
                failed.append({"check": f"logits vs {what}", "rel_err": error, "tolerance": tolerance})


def run_one(model_type: str, grad_clip: float, seed: int) -> dict:
    """One family's row (without its seconds): its outcome, path and detail."""
    import transformers

    try:
        defaults = transformers.CONFIG_MAPPING[model_type]()
    except Exception as error:  # noqa: BLE001 (a config class whose own defaults fail its validation)
        return {"outcome": "config", "path": None, "detail": {"stage": "config defaults", **error_detail(error)}}
    why = not_a_decoder(model_type, defaults)
    if why:
        return {"outcome": "not a decoder", "path": None, "detail": {"why": why}}
    hf = None
    try:
        hf = stage("config", "tiny config", lambda: tiny_config(model_type))
        with tempfile.TemporaryDirectory() as tmp:
            report = check_family(hf, Path(tmp), grad_clip, seed)
    except Outcome as outcome:
        return {"outcome": outcome.outcome, "path": None, "detail": outcome.detail, "hf_config": _jsonable(hf)}
    failed = report.pop("failed")
    outcome = "mismatch" if failed else "exact"
    detail = {"failed": failed, **report} if failed else {"steps": report["steps"]}
    return {"outcome": outcome, "path": report.pop("path"), "detail": detail, "hf_config": _jsonable(hf)}


def _jsonable(value):
    return json.loads(json.dumps(value, default=str))


def worker(model_type: str, result: Path, grad_clip: float, seed: int) -> None:
    """`--worker`: one family in this process (single-threaded, transformers quiet), its row written to `result`."""
    import torch
    import transformers

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    sys.path.insert(0, str(TESTS))
    os.environ.setdefault("MEGATRAIN_MEASURE_RATES", "0")  # (as tests/conftest.py: plans from the default rates)
    row = run_one(model_type, grad_clip, seed)
    result.write_text(json.dumps(row, default=str))


# --- the sweep ---------------------------------------------------------------------------------------------------


def families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def run_in_a_process(model_type: str, args) -> dict:
    """One family's row from a worker process of its own: a hang is a timeout, a hard crash (a segfault, the
    interpreter killed) a crashed row with its stderr's last line, and neither stops the sweep."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "row.json"
        command = [sys.executable, __file__, "--worker", model_type, "--result", str(result)]
        command += ["--grad-clip", str(args.grad_clip), "--seed", str(args.seed)]
        try:
            process = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
            row = json.loads(result.read_text()) if result.exists() else None
            if row is None:
                tail = (process.stderr.strip().splitlines() or ["no output"])[-1][:400]
                row = {
                    "outcome": "crashed",
                    "path": None,
                    "detail": {"stage": "process", "exit": process.returncode, "message": tail},
                }
        except subprocess.TimeoutExpired:
            row = {"outcome": "timeout", "path": None, "detail": {"timeout_s": args.timeout}}
    return {"model_type": model_type, **row, "seconds": round(time.monotonic() - start, 1)}


def machine() -> dict:
    import torch
    import transformers

    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "device": f"CPU only ({platform.processor() or platform.machine()})",
        "gpu_memory_gib": None,
        "host_memory_gib": round(memory, 1),
        "cpu_cores": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": now,
    }


def as_results_row(row: dict, date: str) -> dict:
    """A sweep row in benchmarks/results_schema.py's form: a check, not a timed step (scope; no step time)."""
    schema = {"system": "megatrain", "model": row["model_type"], "tokens_per_step": None, "step_time_s": None}
    schema |= {"tokens_per_s": None, "model_tflops": None, "date": date}
    return schema | {"scope": "3 fp32 steps against transformers + torch AdamW (tests/family_sweep.py)"} | row


OUTCOMES = ("exact", "mismatch", "refused", "crashed", "config", "timeout", "not a decoder")


def summary(rows: list[dict]) -> str:
    """The table printed at the end: counts by outcome, then a line for each family that is not exact."""
    counts = {o: sum(r["outcome"] == o for r in rows) for o in OUTCOMES}
    lines = ["  ".join(f"{o}: {n}" for o, n in counts.items()) + f"  (of {len(rows)})", ""]
    lines.append(f"{'model_type':28} {'outcome':13} {'path':26} {'s':>6}  detail")
    for row in sorted(rows, key=lambda r: (OUTCOMES.index(r["outcome"]), r["model_type"])):
        lines.append(
            f"{row['model_type']:28} {row['outcome']:13} {str(row.get('path')):26} {row['seconds']:6.1f}  "
            f"{short_detail(row)}"
        )
    return "\n".join(lines)


def short_detail(row: dict) -> str:
    detail = row.get("detail") or {}
    if row["outcome"] == "mismatch":
        first = detail["failed"][0]
        numbers = ", ".join(f"{k} {v:.3g}" for k, v in first.items() if isinstance(v, float))
        return f"{first['check']} ({numbers}); {len(detail['failed'])} failed"
    if row["outcome"] in ("refused", "crashed", "config"):
        where = detail.get("megatrain_frame") or detail.get("innermost_frame") or ""
        return f"[{detail.get('stage')}] {detail.get('type', '')}: {detail.get('message', '')[:150]} @ {where}"
    return "" if row["outcome"] == "exact" else json.dumps(detail)[:150]


def kept_rows(results: list[dict], names: list[str]) -> list[dict]:
    """An earlier file's rows of the families not run now, back in the sweep's form (the schema's fields off but
    their date: when each was run)."""
    schema = as_results_row({"model_type": ""}, "")
    return [
        {k: v for k, v in r.items() if k not in schema or k in ("model_type", "date")}
        for r in results
        if r["model_type"] not in names
    ]


def write(rows: list[dict], out: Path, commands: list[str]) -> None:
    info = machine()
    payload = {
        "benchmark": "does megatrain train every transformers causal-LM family exactly like transformers + AdamW?",
        "machine": info,
        "commands": commands,
        "notes": [
            "each decoder family of MODEL_FOR_CAUSAL_LM_MAPPING_NAMES at a tiny size (tests/family_sweep.py), 3 fp32 "
            "steps of megatrain (implementation auto) against transformers + torch AdamW, grad_clip 0.5, as "
            "tests/test_generic.py's check_trains_like_transformers; outcome, path, seconds and detail per row",
        ],
        "results": [as_results_row(r, info["date"]) for r in sorted(rows, key=lambda r: r["model_type"])],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1, default=str) + "\n")


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", help="comma-separated model_types (default: every causal LM)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per family")
    parser.add_argument("--jobs", type=int, default=max(1, len(os.sched_getaffinity(0))), help="families at once")
    parser.add_argument("--grad-clip", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--merge", action="store_true", help="keep --out's rows of the families not run now")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    sys.path.insert(0, str(TESTS))
    if args.worker:
        worker(args.worker, args.result, args.grad_clip, args.seed)
        return 0
    names = args.families.split(",") if args.families else families()
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = []
        for row in pool.map(lambda name: run_in_a_process(name, args), names):
            print(f"{row['model_type']:28} {row['outcome']:13} {row['seconds']:6.1f}s  {short_detail(row)}", flush=True)
            rows.append(row)
    commands = ["python " + " ".join([os.path.relpath(__file__, REPO)] + sys.argv[1:])]
    if args.merge and args.out.exists():
        earlier = json.loads(args.out.read_text())
        rows += kept_rows(earlier["results"], names)
        commands = earlier["commands"] + commands
    write(rows, args.out, commands)
    print("\n" + summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
