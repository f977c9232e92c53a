"""LoRA on streamed frozen weights trains exactly like PEFT: steps of megatrain with model.adapter equal
`peft.get_peft_model` over transformers' model + torch.optim.AdamW on the adapters, step by step (loss, gradient
norm, every adapter; the logits after), in float64, fp32 and bf16, with three micro-batches a step, clipped and
eager, all-linear and subsets (some members of a fused matrix adapted, others not), fused (Phi-3), biased (Qwen2),
output-normed (OLMo 2), delta-rule (Qwen3.5) and mixture-of-experts families (PEFT 0.22's adapters of experts and
routers: Qwen2-MoE, OLMoE, Mixtral, DeepSeek-V3, ERNIE 4.5; Llama 4, gpt-oss, whose experts it leaves) and the generic path, layers
recomputed or keeping their products, in one sweep or two, packed rows, with dropout (PEFT's dropout modules drawing
megatrain's keyed masks), and DPO and GRPO against plain PEFT loops (their references the base, adapters off;
GRPO's over Qwen2-MoE too, its experts' and router's adapters among them); two ranks train as one process, and resume
from their adapter-only checkpoint as a run that never stopped. The frozen base is held once, in the compute dtype,
and stays bit for bit what its checkpoint holds. Bad adapter settings are refused in one line before anything
loads."""

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_steps import NO_DECAY, exact_reference, float64_reference, make_trainer, random_batch, rel_err
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from test_dense_families import hf_dense_model
from test_distributed import assert_same_weights

from megatrain import Trainer
from megatrain.checkpoint import OPTIMIZER_FILE, WEIGHTS_FILE
from megatrain.cli import main
from megatrain.config import AdapterSection, ConfigError, EngineSection, load_config
from megatrain.step import StepBatch
from megatrain_optim import Schedule, lr_at
from megatrain_templates import DropoutKey
from megatrain_zoo import ZooError, preset

R, ALPHA = 4, 8.0
# megatrain's compute dtype: relative tolerances of (losses, gradient norms, adapters, logits) against PEFT in fp32
# or float64. bf16 compute against fp32 from the same bf16 base: at most 9.1e-4, 4.8e-3, 4.8e-4 and 1.7e-2 over 12
# (logits: 7) seeded CPU runs of four steps (Qwen2 and Phi-3, all-linear and q/v), about a third of these
TOLERANCE = {torch.float64: (1e-10,) * 4, torch.float32: (1e-5,) * 4, torch.bfloat16: (3e-3, 1.5e-2, 1.5e-3, 5e-2)}
# linear attention's reference in float64 keeps transformers' fp32 steps (hf_steps.exact_reference says which)
LINEAR_ATTENTION_TOLERANCE = (1e-5, 1e-4, 1e-4, 1e-5)


def peft_name(name: str) -> str:
    """PEFT's name of megatrain's adapter `model.layers.N....lora_A.weight` (the adapter is PEFT's "default")."""
    return "base_model.model." + name.removesuffix(".weight") + ".default.weight"


def lora_trainer(hf_dir, tmp_path, targets, grad_clip, steps, dropout=0.0, **options):
    adapter = AdapterSection(type="lora", r=R, alpha=ALPHA, target_modules=tuple(targets), dropout=dropout)
    return make_trainer(hf_dir, tmp_path, grad_clip, steps, adapter=adapter, **options)


def peft_model(reference, targets):
    # (PEFT takes its shorthand as a string, module names as a list)
    modules = "all-linear" if targets == ["all-linear"] else list(targets)
    return get_peft_model(reference, LoraConfig(r=R, lora_alpha=ALPHA, target_modules=modules, lora_dropout=0.0))


class KeyedDropout(torch.nn.Module):
    """PEFT's `lora_dropout` of module `module` (`self_attn.q_proj`) of layer `layer` (`layer0`) drawing megatrain's
    mask: x times a keep-mask of probability 1 - p from a generator seeded by the key `keys["key"]` (the run's seed,
    the step and the micro-batch, as the test sets it) at the layer and the module, scaled by 1 / (1 - p); no key,
    no dropout."""

    def __init__(self, p: float, layer: str, module: str, keys: dict):
        super().__init__()
        self.p, self.layer, self.module, self.keys = p, layer, module, keys

    def forward(self, x):
        key = self.keys.get("key")
        if key is None:
            return x
        device = self.keys.get("device", x.device)  # (megatrain's device: a CUDA generator draws other masks)
        generator = torch.Generator(device).manual_seed(key.at(self.layer).generator_seed(self.module))
        keep = torch.empty(x.shape, dtype=x.dtype, device=device).bernoulli_(1 - self.p, generator=generator)
        return x * keep.to(x.device) / (1 - self.p)


def keyed_dropouts(model, p: float) -> dict:
    """PEFT `model`'s dropout modules replaced by `KeyedDropout`s, which draw their masks from the key the returned
    dict holds (under "key")."""
    keys = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_dropout"):  # (base_model.model.model.layers.N.self_attn.q_proj)
            layer, inner = name.split(".layers.", 1)[1].split(".", 1)
            module.lora_dropout["default"] = KeyedDropout(p, f"layer{layer}", inner, keys)
    return keys


def dropped_loss(model, ids, labels, keys: dict, key: DropoutKey, micro_batch_size: int) -> torch.Tensor:
    """`mean_loss` of one sequence a row, PEFT's masks keyed as megatrain keys them: the step's `key` at each
    micro-batch (its first row)."""
    total = 0.0
    for start in range(0, ids.shape[0], micro_batch_size):
        keys["key"] = replace(key, micro_batch=start)
        rows = slice(start, start + micro_batch_size)
        total = total + mean_loss(model, ids[rows], labels[rows], [slice(None)]) * (labels[rows] != -100).sum()
    keys["key"] = None
    return total / (labels != -100).sum()


def share_adapters(trainer, model, generator) -> None:
    """megatrain's initial adapters (drawn as PEFT draws them: A uniform within 1 / sqrt(fan_in), B zero), their B
    drawn anew (non-zero, so that A has gradients from the first step), written into the trainer and copied into
    PEFT's `model`, whose adapters are the same matrices."""
    ours = {name: view for name, view in trainer.named_weights().items() if ".lora_" in name}
    theirs = dict(model.named_parameters())
    assert {peft_name(name) for name in ours} == {n for n, p in theirs.items() if p.requires_grad}
    with torch.no_grad():
        for name, view in ours.items():
            assert view.shape == theirs[peft_name(name)].shape, name
            if ".lora_A." in name:
                bound = view.shape[1] ** -0.5
                assert 0.8 * bound < view.abs().max() <= bound, name
            else:
                assert not view.any(), name
                view.copy_(0.1 * torch.randn(view.shape, generator=generator, dtype=view.dtype))
            theirs[peft_name(name)].copy_(view)
    trainer.store.refresh_wire()


def adapter_adamw(model, train):
    """torch's AdamW on the trainable parameters alone, with megatrain's weight-decay rule."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    no_decay = [p for n, p in params.items() if n.endswith(NO_DECAY)]
    decay = [p for n, p in params.items() if not n.endswith(NO_DECAY)]
    groups = [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=train.lr, betas=train.betas, eps=train.eps)


def mean_loss(model, ids, labels, documents) -> torch.Tensor:
    """Mean cross-entropy of megatrain's `labels` (the next token at each position) over the targets, in the logits'
    dtype (transformers' own loss casts float64 logits to fp32), each of `documents` (column slices of the rows) a
    sequence of its own; a mixture of experts' load-balancing loss added as transformers adds it."""
    total, aux = 0.0, None
    for part in documents:
        out = model(input_ids=ids[:, part])
        total = total + torch.nn.functional.cross_entropy(
            out.logits.flatten(0, 1), labels[:, part].flatten(), ignore_index=-100, reduction="sum"
        )
        aux = getattr(out, "aux_loss", None)  # (a mixture of experts' load-balancing loss, over the step's tokens)
    mean = total / (labels != -100).sum()
    if aux is None:
        return mean
    assert len(documents) == 1  # (the balance loss of the whole step's tokens at once)
    return mean + model.config.get_text_config().router_aux_loss_coef * aux


def balance_loss(model, out) -> torch.Tensor | float:
    """A mixture of experts' load-balancing loss of `model`'s forward `out` (over the step's tokens: one
    micro-batch), weighted as transformers adds it; 0 for a model without one."""
    aux = getattr(out, "aux_loss", None)
    return 0.0 if aux is None else model.config.get_text_config().router_aux_loss_coef * aux


def peft_step(model, optimizer, train, step: int, grad_clip: float, loss_of) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step of PEFT's `model` as megatrain takes step `step` of `train` (`reference_step`'s) on the loss
    `loss_of()` makes. Returns (the loss, the gradient norm before clipping at `grad_clip`, 0: none)."""
    schedule = Schedule(train.lr, train.steps, train.warmup_steps, train.schedule, train.min_lr_ratio)
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, schedule)
    optimizer.zero_grad()
    loss = loss_of()
    loss.backward()
    trained = [p for p in model.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(trained, grad_clip or float("inf"))
    optimizer.step()
    return loss, norm


def assert_same_adapters(trainer, model, tolerance: float, step=None) -> None:
    """megatrain's adapters equal PEFT `model`'s within `tolerance` (relative)."""
    theirs = dict(model.named_parameters())
    for adapter, view in trainer.named_weights().items():
        if ".lora_" in adapter:
            assert rel_err(view, theirs[peft_name(adapter)].detach().cpu()) < tolerance, (step, adapter)


def check_steps_match_peft(
    name,
    targets,
    dtype,
    grad_clip,
    tmp_path,
    device="cpu",
    engine=EngineSection(),
    pack=False,
    steps=3,
    dropout=0.0,
    **model,
):
    """`steps` steps of a LoRA run over a tiny transformers model of preset `name` equal PEFT's (`check_steps`), and
    the base the device streams is the checkpoint's, bit for bit. With `dropout`, PEFT's dropout modules draw
    megatrain's masks (`keyed_dropouts`)."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    reference = hf_dense_model(name, seed)
    if dtype == "bfloat16":  # a base that bf16 holds as it is: the reference computes in fp32 from the same weights
        with torch.no_grad():
            for param in reference.parameters():
                param.copy_(param.bfloat16())
    reference.save_pretrained(tmp_path / "hf")
    base = {n: p.detach().clone() for n, p in reference.named_parameters()}
    if preset(name).linear_attention_layers:  # (hf_steps.exact_reference: float64, the recurrences token by token)
        assert dtype == "float64"
        reference, options, stepping = exact_reference(reference, preset(name))
        tolerances = LINEAR_ATTENTION_TOLERANCE
    else:  # (AdamW's epsilon as exact_reference's for fp32; float64 has no noise for it to keep small)
        reference, options = reference.to(torch.float64 if dtype == "float64" else torch.float32), {"adam_eps": 1e-6}
        options["precision"] = dtype
        stepping = float64_reference(reference) if dtype == "float64" else contextlib.nullcontext()
        tolerances = TOLERANCE[getattr(torch, dtype)]
    trainer, train = lora_trainer(
        tmp_path / "hf", tmp_path, targets, grad_clip, steps, dropout, device=device, engine=engine, **options, **model
    )
    model = peft_model(reference, targets)
    keys = keyed_dropouts(model, dropout) if dropout else None
    if keys is not None:
        keys["device"] = torch.device(device)
    with stepping:
        check_steps(trainer, train, model, grad_clip, seed, pack, tolerances, keys)
    if engine.kept_layers != "auto":
        assert len(trainer.pipeline.executed.keeping) == engine.kept_layers
    if engine.sweeps != "auto":
        assert trainer.pipeline.executed.sweeps == engine.sweeps
    if engine.experts_per_stage != "auto":
        assert trainer.spec.expert_parts[0] == (0, engine.experts_per_stage)
    # the base is held once, in the compute dtype; masters and optimizer state are the adapters' alone
    store, spec = trainer.store, trainer.spec
    assert store.arenas["frozen"].dtype == trainer.compute_dtype
    frozen = frozenset(range(store.n_groups)) - spec.adapter_groups
    assert store.frozen_in_compute_dtype == frozen and store.arenas["frozen"].dtype == trainer.compute_dtype
    assert not any(store.master_numel(g) or store.state_numel(g) or store.grad_numel(g) for g in frozen)
    streamed = trainer.streamed_weights()
    # (transformers' fused expert tensors are stored expert by expert: the one-to-one names compared here, the
    # experts through the steps' and logits' equality)
    fused = {n for n in base if ".experts." in n and n not in streamed}
    # (transformers >= 5 names Mixtral's block_sparse_moe mlp, and holds ERNIE 4.5's correction bias in the router;
    # the store keeps the published names)
    renames = {".block_sparse_moe.": ".mlp.", ".mlp.moe_statics.": ".mlp.gate.moe_statics."}
    streamed.update({_renamed(n, renames): t for n, t in streamed.items()})
    assert not any(".lora_" in n for n in base) and set(base) - fused <= set(streamed)
    for param_name, value in base.items():
        if param_name not in fused:
            assert torch.equal(streamed[param_name].cpu().to(value.dtype), value), param_name
    trainer.close()


def _renamed(name: str, renames: dict[str, str]) -> str:
    for old, new in renames.items():
        name = name.replace(old, new)
    return name


def check_steps(trainer, train, model, grad_clip, seed, pack, tolerances, keys=None):
    """megatrain's `trainer` and PEFT's `model` (with the same adapters from here) take the same steps on fresh random
    batches of train.batch_size rows in micro-batches (with `pack`, each row two documents, positions restarting at
    the second): loss, gradient norm and every adapter after each step, and the logits after the last, within
    `tolerances` (`TOLERANCE`'s); with `keys` (`keyed_dropouts`'), PEFT's dropout masks keyed by the step."""
    generator = torch.Generator().manual_seed(seed)
    share_adapters(trainer, model, generator)
    optimizer = adapter_adamw(model, train)
    loss_tolerance, norm_tolerance, tolerance, logits_tolerance = tolerances
    documents = [slice(0, 5), slice(5, 12)] if pack else [slice(0, 12)]
    clipped = 0
    for step in range(train.steps):
        ids, labels = random_batch(train.batch_size, 12, trainer.model_config.vocab_size, generator)
        positions = None
        if pack:
            labels[:, 4] = -100  # (the first document's last token has no target in the second)
            positions = torch.cat([torch.arange(5), torch.arange(7)]).expand(train.batch_size, 12)
        metrics = trainer.train_step(StepBatch(ids, labels, position_ids=positions))
        if keys is None:
            loss, norm = peft_step(
                model, optimizer, train, step, grad_clip, lambda: mean_loss(model, ids, labels, documents)
            )
        else:
            key, size = DropoutKey(train.seed, step, 0), train.micro_batch_size
            loss, norm = peft_step(
                model, optimizer, train, step, grad_clip, lambda: dropped_loss(model, ids, labels, keys, key, size)
            )
        assert metrics.loss == pytest.approx(loss.item(), rel=loss_tolerance)
        assert metrics.grad_norm == pytest.approx(norm.item(), rel=norm_tolerance)
        clipped += bool(grad_clip) and norm.item() > grad_clip
        assert_same_adapters(trainer, model, tolerance, step)
    assert clipped or not grad_clip  # clipping really acts where on
    with torch.no_grad():  # the trained adapters' logits, outside a step
        ids = torch.randint(0, trainer.model_config.vocab_size, (2, 12), generator=generator)
        assert rel_err(trainer.logits(ids).cpu(), model(input_ids=ids).logits) < logits_tolerance


@pytest.mark.parametrize(
    "name, targets, dtype, grad_clip",
    [
        ("tiny-qwen2", ["all-linear"], "float32", 0.05),
        ("tiny-qwen2", ["q_proj", "v_proj", "up_proj"], "float64", 0.0),
        ("tiny-phi3", ["all-linear"], "float64", 0.05),
        ("tiny-phi3", ["qkv_proj", "down_proj"], "float32", 0.0),
        ("tiny-olmo2", ["k_proj", "o_proj", "down_proj"], "float64", 0.05),
        ("tiny-qwen3.5", ["all-linear"], "float64", 0.05),
    ],
)
def test_steps_match_peft(name, targets, dtype, grad_clip, tmp_path):
    """Qwen2's q and v adapted, k not, in its one fused q/k/v GEMM (and up, not gate, of the fused gate/up); Phi-3's
    fused projections adapted whole, as PEFT adapts them; OLMo 2's down projection with the norm after it; Qwen3.5's
    delta-rule layers' projections."""
    check_steps_match_peft(name, targets, dtype, grad_clip, tmp_path)


@pytest.mark.parametrize(
    "name, targets, dtype, kept_layers",
    [
        ("tiny-qwen2-moe", ["q_proj", "v_proj", "down_proj"], "float32", "auto"),
        ("tiny-qwen2-moe", ["all-linear"], "float32", 1),
        ("tiny-olmoe", ["gate_proj", "up_proj"], "float32", "auto"),
        ("tiny-mixtral", ["q_proj", "w1", "w3", "w2"], "float32", 1),
        ("tiny-deepseek-v3", ["all-linear"], "float32", "auto"),
        ("tiny-llama4", ["q_proj", "v_proj", "down_proj"], "float32", "auto"),
        ("tiny-gpt-oss", ["all-linear"], "float32", "auto"),
        ("tiny-ernie4_5-moe", ["all-linear"], "float32", 1),
    ],
)
def test_a_mixture_of_experts_steps_match_peft(name, targets, dtype, kept_layers, tmp_path):
    """PEFT 0.22 adapts what transformers fuses: each expert's fused gate-up matrix (rank 2r where both its members
    are named), its down matrix, and under all-linear the router (Qwen2-MoE's softmax, DeepSeek-V3's sigmoid in fp32),
    beside the shared expert and its gate; Llama 4's experts not (stored fused, they are parameters; its router, an
    nn.Linear returning a tuple, crashes PEFT's LoRA), its shared expert's down projection; gpt-oss' attention alone.
    A layer keeping its products recomputes the experts' adapters."""
    engine = EngineSection(kept_layers=kept_layers)
    check_steps_match_peft(name, targets, dtype, 0.05, tmp_path, engine=engine)


@pytest.mark.parametrize(
    "name, targets, dropout",
    [
        ("tiny-qwen2-moe", ["all-linear"], 0.0),
        ("tiny-deepseek-v3", ["all-linear"], 0.0),
        ("tiny-mixtral", ["q_proj", "w1", "w3", "w2"], 0.0),
        ("tiny-olmoe", ["q_proj", "v_proj", "o_proj"], 0.1),
        ("tiny-gpt-oss", ["all-linear"], 0.0),
    ],
)
def test_a_mixture_of_experts_streamed_in_parts_steps_match_peft(name, targets, dropout, tmp_path):
    """A MoE layer streamed in parts of 3 experts (a layer too large for a GPU slot): the attention stage binds the
    layer's whole adapter group, each part its experts' slice and the router's adapter; the steps are PEFT's. Qwen2-MoE
    (softmax router, shared expert) and DeepSeek-V3 (sigmoid router, correction bias) all-linear; Mixtral's gate-up
    and down; OLMoE's attention with dropout (the attention stage draws its layer's masks; dropout on the experts is
    refused, as PEFT refuses it) and gpt-oss, whose parts bind no adapters."""
    engine = EngineSection(experts_per_stage=3)
    # (with dropout one micro-batch a step: the reference's balance loss is a micro-batch's, megatrain's the step's)
    batch = {"batch_size": 2} if dropout else {}
    check_steps_match_peft(name, targets, "float32", 0.05, tmp_path, engine=engine, dropout=dropout, **batch)


def test_the_generic_path_steps_match_peft(tmp_path):
    """transformers' own layers (model.implementation: transformers), each targeted nn.Linear hooked."""
    check_steps_match_peft("tiny-qwen2", ["all-linear"], "float64", 0.05, tmp_path, implementation="transformers")


def test_bf16_steps_match_peft_in_fp32(tmp_path):
    """bf16 compute (the base held once in bf16, the adapters' masters in fp32) within bf16's rounding of fp32 PEFT."""
    check_steps_match_peft("tiny-qwen2", ["all-linear"], "bfloat16", 0.05, tmp_path, steps=4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_steps_match_peft(dtype, tmp_path):
    """The CUDA engine (fp32 with TF32 off, as the dense families' GPU test; and bf16) against PEFT on the CPU, q and
    v of the fused q/k/v adapted, k not; layers keep their products where the GPU has room."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    check_steps_match_peft("tiny-qwen2", ["q_proj", "v_proj", "down_proj"], dtype, 0.05, tmp_path, "cuda", steps=4)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "engine", [EngineSection(kept_layers=1), EngineSection(experts_per_stage=3)], ids=["whole", "parts"]
)
def test_gpu_mixture_of_experts_steps_match_peft(engine, tmp_path):
    """The experts' and the router's adapters on the CUDA engine (fp32, TF32 off) against PEFT 0.22 on the CPU, one
    layer keeping its products, or each layer's experts in parts of 3. (bf16 against fp32 would flip near-tied
    routing choices now and then: the grouped kernel's bf16 path is `test_expert_kernels.py`'s, against float64.)"""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    check_steps_match_peft("tiny-qwen2-moe", ["all-linear"], "float32", 0.05, tmp_path, "cuda", engine=engine)


@pytest.mark.gpu
def test_gpu_dropout_matches_peft_with_the_same_masks(tmp_path):
    """Dropout 0.1 on the CUDA engine (fp32, TF32 off): its masks drawn by CUDA generators from the same keys, PEFT's
    on the CPU drawing them there too; two micro-batches in two sweeps, one layer recomputed, one keeping products."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    engine = EngineSection(kept_layers=1, sweeps=2)
    check_steps_match_peft(
        "tiny-qwen2", ["all-linear"], "float32", 0.05, tmp_path, "cuda", engine=engine, steps=2, dropout=0.1,
        batch_size=4,
    )  # fmt: skip


def test_layers_keeping_their_products_in_two_sweeps_match_peft(tmp_path):
    """A layer that keeps its base's GEMM products from the forward (the backward's stand-in for them) still
    recomputes its adapters' (the down projection's by hand); the step's micro-batches in two sweeps, the adapters'
    gradients summed over them."""
    engine = EngineSection(kept_layers=1, sweeps=2)
    check_steps_match_peft("tiny-qwen2", ["all-linear"], "float64", 0.05, tmp_path, engine=engine)


def test_packed_rows_match_peft_on_the_documents_apart(tmp_path):
    check_steps_match_peft("tiny-qwen2", ["all-linear"], "float64", 0.0, tmp_path, pack=True)


@pytest.mark.parametrize(
    "name, targets, dtype, implementation, rows",
    [
        ("tiny-qwen2", ["all-linear"], "float64", "auto", 4),
        ("tiny-qwen2", ["all-linear"], "float64", "transformers", 4),
        # (one micro-batch: PEFT's balance loss is over the step's tokens at once)
        ("tiny-llama4", ["q_proj", "v_proj", "down_proj"], "float32", "auto", 2),
    ],
)
def test_dropout_matches_peft_with_the_same_masks(name, targets, dtype, implementation, rows, tmp_path):
    """LoRA dropout 0.1, PEFT's dropout modules drawing megatrain's masks (a function of the run's seed, the step, the
    micro-batch, the layer and the module: q, k and v of the fused GEMM each their own): steps of two micro-batches
    in two sweeps (the MoE's of one), one layer recomputed in its backward and one keeping its products, equal PEFT's
    only where each backward draws its forward's masks again. Native dense and MoE templates, and the generic path
    (transformers' layers, hooked)."""
    sweeps = rows // 2  # (micro-batches of two rows, a sweep each)
    engine = EngineSection(kept_layers=1, sweeps=sweeps) if implementation == "auto" else EngineSection(sweeps=sweeps)
    check_steps_match_peft(
        name, targets, dtype, 0.05, tmp_path, engine=engine, steps=2, dropout=0.1, batch_size=rows,
        implementation=implementation,
    )  # fmt: skip


def test_dropout_masks_follow_the_seed(tmp_path):
    """Two runs of one model, adapters and batch: the same seed takes the same step (its masks reproducible), another
    seed another (other masks)."""
    hf_dense_model("tiny-qwen2", 0).save_pretrained(tmp_path / "hf")
    ids, labels = random_batch(4, 12, preset("tiny-qwen2").vocab_size, torch.Generator().manual_seed(0))
    losses = []
    for seed in (1, 1, 2):
        trainer, _ = lora_trainer(tmp_path / "hf", tmp_path / str(len(losses)), ["all-linear"], 0.0, 1, 0.5)
        # (the masks' seed alone: each run drew its adapters with the seed it was made with, 0)
        trainer.config = replace(trainer.config, train=replace(trainer.config.train, seed=seed))
        with torch.no_grad():  # (B non-zero, the same in each run: the adapters' delta, and so the masks, count)
            for name, view in trainer.named_weights().items():
                if ".lora_B." in name:
                    view.copy_(torch.randn(view.shape, generator=torch.Generator().manual_seed(1), dtype=view.dtype))
        trainer.store.refresh_wire()
        losses.append(trainer.train_step(StepBatch(ids, labels)).loss)
        trainer.close()
    assert losses[0] == losses[1] != losses[2]


def lora_config(tmp_path, **adapter):
    """A config of a tiny Qwen2 preset with `adapter` (model.adapter's keys), as a user's overrides give it."""
    overrides = ["model.preset=tiny-qwen2", "model.adapter.type=lora", "device=cpu", f"output_dir={tmp_path / 'run'}"]
    return load_config(None, overrides + [f"model.adapter.{key}={value}" for key, value in adapter.items()])


def refused_before_loading(config, monkeypatch) -> str:
    """The one-line message `Trainer(config)` refuses `config` with, before it allocates any store."""

    def no_store(*args, **kwargs):
        raise AssertionError("the store was allocated before the config was refused")

    monkeypatch.setattr("megatrain.trainer.new_store", no_store)
    with pytest.raises((ConfigError, ZooError)) as refused:
        Trainer(config)
    message = str(refused.value)
    assert "\n" not in message
    return message


def test_target_modules_matching_nothing_are_refused(tmp_path, monkeypatch):
    message = refused_before_loading(lora_config(tmp_path, target_modules="[q_proj,qkv_proj]"), monkeypatch)
    assert "'qkv_proj' matches no linear layer of this model" in message
    assert "q_proj" in message.split("its layers have")[1]  # it names those there are


def test_a_rank_below_one_is_refused(tmp_path):
    for r in (0, -4):
        with pytest.raises(ConfigError, match=f"model.adapter.r must be a positive rank, got {r}$"):
            lora_config(tmp_path, r=r)


def test_dropout_on_what_transformers_fuses_is_refused(tmp_path, monkeypatch):
    """PEFT 0.22 applies no dropout to a fused expert matrix or a router it adapts as a parameter: nor does megatrain,
    which refuses before anything loads, as it refuses naming one of a fused pair."""
    overrides = ["model.preset=tiny-qwen2-moe", "model.adapter.target_modules=[q_proj,down_proj]"]
    config = load_config(None, [*overrides, "model.adapter.dropout=0.1"], base=lora_config(tmp_path).as_dict())
    message = refused_before_loading(config, monkeypatch)
    assert "model.adapter.dropout 0.1 on experts_down: LoRA dropout can't be applied" in message
    config = load_config(
        None, ["model.preset=tiny-qwen2-moe", "model.adapter.target_modules=[up_proj]"], base=config.as_dict()
    )
    message = refused_before_loading(config, monkeypatch)
    assert "names up_proj but not gate_proj: each expert's gate_proj and up_proj are one fused matrix" in message


@pytest.mark.parametrize("saved, resumed", [("auto", 3), (2, "auto")])
def test_a_mixture_of_experts_adapters_resume_whatever_the_experts_parts(saved, resumed, tmp_path):
    """A layer's adapter group is laid out alike whole and in parts (`MoeBlock._adapt`'s), so a LoRA run of Qwen2-MoE
    (all-linear: the experts', router's and shared expert's adapters) saved with whole layers resumes with its experts
    in parts, or the other way round: the same loss and adapters to fp32 rounding (the parts sum the experts' outputs
    in another order)."""
    from megatrain.checkpoint import resolve_resume, save_checkpoint

    hf_dense_model("tiny-qwen2-moe", 7).save_pretrained(tmp_path / "hf")
    generator = torch.Generator().manual_seed(7)
    batches = [random_batch(6, 12, preset("tiny-qwen2-moe").vocab_size, generator) for _ in range(3)]

    def trainer(experts_per_stage):
        engine = EngineSection(experts_per_stage=experts_per_stage)
        return lora_trainer(tmp_path / "hf", tmp_path, ["all-linear"], 0.5, 3, engine=engine, precision="float32")[0]

    first = trainer(saved)
    for ids, labels in batches[:2]:
        first.train_step(StepBatch(ids, labels))
    checkpoint = save_checkpoint(first.state_dict(), tmp_path / "checkpoints")
    expected = first.train_step(StepBatch(*batches[2])).loss
    want = {name: view.clone() for name, view in first.named_weights().items() if ".lora_" in name}
    first.close()
    second = trainer(resumed)
    assert bool(second.spec.expert_parts) == (resumed != "auto")
    second.load_state_dict(resolve_resume(checkpoint).state())
    assert second.train_step(StepBatch(*batches[2])).loss == pytest.approx(expected, rel=1e-6)
    got = {name: view for name, view in second.named_weights().items() if ".lora_" in name}
    assert got.keys() == want.keys() and any(".experts." in name for name in got)
    for name in want:
        assert rel_err(got[name], want[name]) < 1e-6, name
    second.close()


def lora_run(tmp_path, name: str, ranks: int, steps: int, resume=False, base_dtype=None, dropout=0.0, **train):
    """`megatrain train` of a LoRA run of a tiny Qwen2 preset (clipping, three micro-batches of each rank's rows) to
    `steps` in this process (`ranks` 1) or in torchrun's ranks, resuming run `name` or anew with `train`'s settings, its
    base held as `base_dtype` says (None: fp32), with LoRA `dropout`; (its metrics rows, its final adapters by
    megatrain's names)."""
    adapter = {"type": "lora", "r": R, "alpha": ALPHA, "base_dtype": base_dtype, "dropout": dropout}
    config = {
        "model": {"preset": "tiny-qwen2", "adapter": adapter},
        "data": {"seq_len": 16, "shuffle": True, "tokens": str(tmp_path / "tokens.npy")},
        # (a constant learning rate: a run stopped at step 2 takes the steps of one going on to 4)
        "train": {"steps": steps, "batch_size": 12, "micro_batch_size": 2, "lr": 1e-3, "schedule": "constant"}
        | {"grad_clip": 0.05, **train},
        "precision": {"compute_dtype": "float32"},
        "device": "cpu",
        "output_dir": str(tmp_path / name),
    }
    path = tmp_path / f"{name}-{steps}.yaml"
    path.write_text(json.dumps(config))
    args = ["train", "--config", str(path), *(["--resume", str(tmp_path / name)] if resume else [])]
    if ranks == 1:
        assert main(args) == 0
    else:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGATRAIN_SHARED_DIR": str(tmp_path / "shm")}
        launcher = Path(__file__).with_name("forked_ranks.py")  # (torchrun's ranks, torch imported once for all)
        command = [sys.executable, str(launcher), f"--nproc-per-node={ranks}", "--standalone"]
        done = subprocess.run([*command, "-m", "megatrain", *args], env=env, capture_output=True)
        assert done.returncode == 0, done.stderr.decode()
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    final = {}  # (the final model's adapters, under PEFT's names or megatrain's)
    for weights in (tmp_path / name / "final").glob("*.safetensors"):
        final |= {k.removeprefix("base_model.model."): t for k, t in load_file(str(weights)).items() if ".lora_" in k}
    return rows, final


def test_two_ranks_train_the_adapters_as_one_process_and_resume_on_one(tmp_path):
    """Data parallel: the ranks reduce their adapter gradients, and take one process's steps; their checkpoint holds
    the adapters and their optimizer state alone (the base is the run's start again), and a process that resumes
    from it continues as one that never stopped. With dropout: each micro-batch's masks are keyed by its first row
    in the step, whichever rank runs it, and by the step, which resume restores."""
    np.save(tmp_path / "tokens.npy", np.random.default_rng(577).integers(0, 256, 40 * 16).astype(np.int32))
    rows, adapters = lora_run(tmp_path, "whole", 1, steps=4, dropout=0.1)
    assert len(rows) == 4 and rows[0]["grad_norm"] > 0.05  # (clipping acts)
    assert adapters and all(adapter.any() for adapter in adapters.values())  # (B moved off zero)
    two_ranks, _ = lora_run(tmp_path, "part", 2, steps=2, dropout=0.1, save_every=2)
    for a, b in zip(rows, two_ranks, strict=False):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    checkpoint = tmp_path / "part" / "checkpoints" / "step-00000002"
    saved = load_file(str(checkpoint / WEIGHTS_FILE))
    assert set(saved) == set(adapters)
    assert {k.split(".", 1)[1] for k in load_file(str(checkpoint / OPTIMIZER_FILE))} == set(adapters)
    resumed, resumed_adapters = lora_run(tmp_path, "part", 1, steps=4, resume=True, dropout=0.1)
    assert [row["step"] for row in resumed] == [1, 2, 3, 4]
    for a, b in zip(rows, resumed):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    # (B's first updates are lr * sign(gradient): an absolute floor for its elements whose gradient is fp32 noise)
    assert_same_weights(adapters, resumed_adapters)


def objective_run(tmp_path, train, seq_len: int, base_dtype=None, dropout=0.0, name="tiny-qwen2"):
    """(megatrain's trainer of `train`'s objective over a tiny transformers model of preset `name` (fp32) with
    all-linear adapters, PEFT's model of the same base and adapters (B drawn non-zero, so that the policy and the
    base differ), the generator of the step's data, torch AdamW on PEFT's adapters). `base_dtype` nf4 or int8:
    megatrain's base packed, PEFT's its layers' matrices dequantized (`megatrain_store.packed.round_trip`, which
    test_quant.py checks against bitsandbytes)."""
    from megatrain.config import Config, ModelSection, PrecisionSection
    from megatrain_data import DataSection
    from megatrain_store import Entry
    from megatrain_store.packed import quantizes, round_trip

    reference = hf_dense_model(name, train.seed)
    reference.save_pretrained(tmp_path / "hf")
    if base_dtype is not None:
        with torch.no_grad():
            for name, param in reference.named_parameters():
                if name.startswith("model.layers.") and quantizes(Entry(name, tuple(param.shape), 0, True)):
                    param.copy_(round_trip(param.detach().float(), base_dtype))
    adapter = AdapterSection(
        type="lora", r=R, alpha=ALPHA, target_modules=("all-linear",), base_dtype=base_dtype, dropout=dropout
    )
    config = Config(
        model=ModelSection(hf_dir=str(tmp_path / "hf"), adapter=adapter),
        data=DataSection(seq_len=seq_len),
        train=train,
        precision=PrecisionSection("float32"),
        device="cpu",
        output_dir=str(tmp_path / "run"),
    )
    trainer = Trainer(config)
    model = peft_model(reference, ["all-linear"])
    generator = torch.Generator().manual_seed(train.seed)
    share_adapters(trainer, model, generator)
    return trainer, model, generator, adapter_adamw(model, train)


@pytest.mark.parametrize("base_dtype, dropout", [(None, 0.0), ("nf4", 0.0), (None, 0.1)])
def test_dpo_with_adapters_equals_a_peft_dpo_loop(base_dtype, dropout, tmp_path):
    """DPO over LoRA adapters: the reference is the base with the adapters off (`reference.adapters_off`, as TRL's
    with a PEFT model under `disable_adapter()`), and the steps equal a plain PEFT loop of the paper's loss with
    torch AdamW on the adapters (fp32; B non-zero from the start, so the policy and the reference differ); over a
    base held in fp32 or packed in nf4 (QLoRA: PEFT's base then its dequantized weights); with dropout in the
    policy's passes alone (PEFT's modules drawing megatrain's masks, a pair's micro-batch keyed by its first row)."""
    from test_dpo import SEQ, completion_logps, paper_loss, random_pairs

    from megatrain.config import DPOSection, TrainSection
    from megatrain.reference import adapters_off
    from megatrain_data import Batch

    dpo, n_pairs = DPOSection(beta=0.5), 3
    train = TrainSection(
        steps=3, batch_size=n_pairs, micro_batch_size=1, lr=1e-3, eps=1e-6, weight_decay=0.1, grad_clip=0.0,
        warmup_steps=1, seed=int(torch.randint(0, 2**31 - 1, ()).item()), objective="dpo", dpo=dpo,
    )  # fmt: skip
    trainer, model, generator, optimizer = objective_run(tmp_path, train, SEQ, base_dtype, dropout)
    keys = keyed_dropouts(model, dropout) if dropout else {}
    for step in range(train.steps):
        ids, labels = random_pairs(n_pairs, trainer.model_config.vocab_size, generator)
        rows = Batch(ids, labels)
        with torch.no_grad(), model.disable_adapter():
            ref_sums, lengths = completion_logps(model, ids, labels)
        with adapters_off(trainer):
            ours_reference = trainer.sequence_logps(StepBatch(ids, labels, sequences=rows.sequences))
        assert rel_err(ours_reference.logps, ref_sums) < 1e-5
        metrics = trainer.train_step(StepBatch(ids, labels, extras=ours_reference, sequences=rows.sequences))

        def dpo_loss():
            sums = []
            for pair in range(n_pairs):  # (a micro-batch a pair: its two rows, its masks keyed by its first row)
                keys["key"] = DropoutKey(train.seed, step, 2 * pair) if dropout else None
                sums.append(completion_logps(model, ids[2 * pair : 2 * pair + 2], labels[2 * pair : 2 * pair + 2])[0])
            keys["key"] = None
            sums = torch.cat(sums)
            return paper_loss(sums, lengths.to(sums), ref_sums.to(sums), dpo)

        loss, norm = peft_step(model, optimizer, train, step, 0.0, dpo_loss)
        assert metrics.loss == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
        assert metrics.grad_norm == pytest.approx(norm.item(), rel=1e-4)
    assert_same_adapters(trainer, model, 1e-4)
    trainer.close()


@pytest.mark.parametrize("name, dropout", [("tiny-qwen2", 0.0), ("tiny-qwen2", 0.1), ("tiny-qwen2-moe", 0.0)])
def test_grpo_with_adapters_equals_a_peft_loop(name, dropout, tmp_path):
    """GRPO over LoRA adapters, with the KL term: the reference the store streams (`keep_reference`, its adapter
    groups zero) is the base with the adapters off, PEFT's under `disable_adapter()`, and the steps equal TRL's loss
    on a PeftModel with torch AdamW on the adapters (fp32; B non-zero from the start); with dropout in the policy's
    pass alone (PEFT's modules drawing megatrain's masks: the step's one micro-batch, keyed by row 0); over a mixture
    of experts, its experts' and router's adapters off in the reference too, and the step's load-balancing loss added
    (`balance_loss`)."""
    from test_grpo import CASES_GRPO, SEQ, random_groups, token_logps, trl_advantages, trl_loss

    from megatrain.config import TrainSection
    from megatrain_templates import Rollout

    grpo, n_prompts = CASES_GRPO["grpo-kl"], 2
    rows = n_prompts * grpo.num_generations
    train = TrainSection(
        steps=3, batch_size=rows, micro_batch_size=rows, lr=1e-3, eps=1e-6, weight_decay=0.1, grad_clip=0.0,
        warmup_steps=1, seed=int(torch.randint(0, 2**31 - 1, ()).item()), objective="grpo", grpo=grpo,
    )  # fmt: skip
    trainer, model, generator, optimizer = objective_run(tmp_path, train, SEQ, dropout=dropout, name=name)
    keys = keyed_dropouts(model, dropout) if dropout else {}
    trainer.keep_reference()  # (after the adapters are set: the reference must still be the base alone)
    for step in range(train.steps):
        ids, labels = random_groups(n_prompts, grpo.num_generations, trainer.model_config.vocab_size, generator)
        rewards = torch.rand(rows, generator=generator, dtype=torch.float64)
        advantages = trl_advantages(rewards, grpo.num_generations, grpo.scale_rewards)
        with torch.no_grad(), model.disable_adapter():
            ref = token_logps(model, ids, labels)
        ours_ref = trainer.token_logps(StepBatch(ids, labels), reference=True)
        assert rel_err(ours_ref, ref) < 1e-5
        metrics = trainer.train_step(StepBatch(ids, labels, extras=Rollout(advantages, None, ours_ref)))

        def grpo_loss():
            keys["key"] = DropoutKey(train.seed, step, 0) if dropout else None
            out = model(input_ids=ids)  # (token_logps' pass, its balance loss kept)
            keys["key"] = None
            logps = out.logits.log_softmax(-1).gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
            logps = logps * (labels != -100)
            loss = trl_loss(logps, logps.detach(), ref, advantages.to(logps), labels != -100, grpo)
            return loss + balance_loss(model, out)

        loss, norm = peft_step(model, optimizer, train, step, 0.0, grpo_loss)
        assert metrics.loss == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
        assert metrics.grad_norm == pytest.approx(norm.item(), rel=1e-4)
    assert_same_adapters(trainer, model, 1e-4)
    trainer.close()


def test_the_generic_path_says_its_targets_reach_no_routed_expert(tmp_path):
    """Qwen2-MoE through transformers' own layers: LoRA hooks nn.Linear layers, which its fused experts are not
    (the native template adapts them, as PEFT 0.22 does): the run's warning says so."""
    from megatrain_zoo.peft import experts_note

    model = hf_dense_model("tiny-qwen2-moe", 0)
    model.config.output_router_logits = False  # (the generic path adds no balance loss)
    model.save_pretrained(tmp_path / "hf")
    trainer, _ = lora_trainer(tmp_path / "hf", tmp_path, ["all-linear"], 0.0, 1, implementation="transformers")
    assert "['all-linear'] adapt no routed expert on the generic path" in experts_note(trainer.spec)
    trainer.close()


def test_the_generic_path_adapts_what_peft_loads_and_refuses_what_it_cannot_adapt():
    """LoRA on transformers' own layers: GPT-2's Conv1D layers are refused in one line (all-linear adapted nothing,
    silently); Falcon-H1's Mamba out_proj, which PEFT takes no LoRA on, is left out of all-linear (its export did not
    load in PEFT) and refused by name; Phi-MoE's router, an nn.Linear returning a tuple, is not adapted (it crashed
    the step)."""
    import transformers
    from family_sweep import tiny_config
    from test_generic import tiny_hf_config

    from megatrain_templates import Lora
    from megatrain_zoo.generic_adapters import LinearAdapters

    def adapted(family: str, *targets: str) -> set[str]:
        config = transformers.AutoConfig.for_model(**tiny_hf_config(family))
        layer = transformers.AutoModelForCausalLM.from_config(config).base_model.layers[0]
        adapters = LinearAdapters(layer, "model.layers.0.", Lora(4, 8.0, targets), config.model_type)
        return {name.split(".")[-3] for name in adapters.names}

    with pytest.raises(ZooError, match=r"transformer\.h\.0\.attn\.c_attn is a transformers Conv1D layer"):
        config = transformers.AutoConfig.for_model(**tiny_hf_config("gpt2"))
        layer = transformers.AutoModelForCausalLM.from_config(config).transformer.h[0]
        LinearAdapters(layer, "transformer.h.0.", Lora(4, 8.0, ("all-linear",)), "gpt2")
    assert "out_proj" not in adapted("falcon_h1", "all-linear") and "in_proj" in adapted("falcon_h1", "all-linear")
    with pytest.raises(ZooError, match="PEFT takes no LoRA on falcon_h1's out_proj"):
        adapted("falcon_h1", "out_proj")
    assert adapted("phimoe", "all-linear") == {"q_proj", "k_proj", "v_proj", "o_proj"}
    with pytest.raises(ZooError, match=r"model.layers.0.mlp.router is a router \(PhimoeTopKRouter\)"):
        adapted("phimoe", "router")
    # (Falcon's linears subclass nn.Linear with a forward of their own that returns their product: adapted, as PEFT)
    falcon = transformers.AutoConfig.for_model(**tiny_config("falcon"))
    layer = transformers.AutoModelForCausalLM.from_config(falcon).transformer.h[0]
    adapters = LinearAdapters(layer, "transformer.h.0.", Lora(4, 8.0, ("all-linear",)), "falcon")
    assert len(adapters.names) == 2 * sum(isinstance(m, torch.nn.Linear) for m in layer.modules()) > 0
