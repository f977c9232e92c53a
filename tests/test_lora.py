"""LoRA on streamed frozen weights trains exactly like PEFT: steps of megatrain with model.adapter (fp32 and float64,
micro-batches, clipped and eager, all-linear and a subset that adapts some members of a fused matrix, fused and
biased families, packed rows) equal `peft.get_peft_model` over transformers' model + torch.optim.AdamW on the
adapters, step by step (loss, gradient norm, adapters); the frozen base stays bit for bit what the checkpoint holds;
bad adapter settings are refused in one line before anything loads."""

import contextlib

import pytest
import torch
from hf_steps import NO_DECAY, make_trainer, random_batch, rel_err
from peft import LoraConfig, get_peft_model
from test_dense_families import hf_dense_model

from megatrain.config import AdapterSection, EngineSection
from megatrain.step import StepBatch
from megatrain_optim import Schedule, lr_at

R, ALPHA = 4, 8.0


def peft_name(name: str) -> str:
    """PEFT's name of megatrain's adapter `model.layers.N....lora_A.weight` (the adapter is PEFT's "default")."""
    return "base_model.model." + name.removesuffix(".weight") + ".default.weight"


def lora_trainer(hf_dir, tmp_path, targets, grad_clip, steps, **options):
    adapter = AdapterSection(type="lora", r=R, alpha=ALPHA, target_modules=tuple(targets))
    return make_trainer(hf_dir, tmp_path, grad_clip, steps, adapter=adapter, **options)


def peft_model(reference, targets):
    config = LoraConfig(r=R, lora_alpha=ALPHA, target_modules=list(targets), lora_dropout=0.0)
    if targets == ["all-linear"]:
        config = LoraConfig(r=R, lora_alpha=ALPHA, target_modules="all-linear", lora_dropout=0.0)
    return get_peft_model(reference, config)


def share_adapters(trainer, model, generator) -> dict[str, torch.Tensor]:
    """megatrain's initial adapters, their B drawn anew (non-zero, so that A's gradients are too from the first
    step), written into the trainer and copied into PEFT's `model`; returns megatrain's adapters by name."""
    ours = {name: view for name, view in trainer.named_weights().items() if ".lora_" in name}
    theirs = dict(model.named_parameters())
    assert {peft_name(name) for name in ours} == {n for n, p in theirs.items() if p.requires_grad}
    with torch.no_grad():
        for name, view in ours.items():
            assert view.any() == (".lora_A." in name)  # PEFT's init: A drawn, B zero
            if ".lora_B." in name:
                view.copy_(0.1 * torch.randn(view.shape, generator=generator, dtype=view.dtype))
            theirs[peft_name(name)].copy_(view)
    trainer.store.refresh_wire()
    return ours


def adapter_adamw(model, train):
    """torch's AdamW on the trainable parameters alone, with megatrain's weight-decay rule."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    no_decay = [p for n, p in params.items() if n.endswith(NO_DECAY)]
    decay = [p for n, p in params.items() if not n.endswith(NO_DECAY)]
    groups = [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=train.lr, betas=train.betas, eps=train.eps)


def peft_step(model, optimizer, train, step: int, grad_clip: float, ids, labels, **inputs):
    """`reference_step` with the loss in the logits' dtype (transformers' own loss casts float64 logits to fp32):
    the mean cross-entropy of megatrain's labels (the next token at each position). Returns (loss, gradient norm
    before clipping)."""
    schedule = Schedule(train.lr, train.steps, train.warmup_steps, train.schedule, train.min_lr_ratio)
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, schedule)
    optimizer.zero_grad()
    logits = model(input_ids=ids, **inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()
    trained = [p for p in model.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(trained, grad_clip or float("inf"))
    optimizer.step()
    return loss, norm


def rms_norm_in_input_dtype(self, hidden_states):
    """transformers' RMSNorm in its input's dtype (its own computes in fp32, which a float64 reference cannot)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


@contextlib.contextmanager
def norms_in_input_dtype(model):
    """`model`'s RMSNorm classes computing in their input's dtype, within the block."""
    classes = {type(m) for m in model.modules() if type(m).__name__.endswith("RMSNorm")}
    saved = {c: c.forward for c in classes}
    for c in classes:
        c.forward = rms_norm_in_input_dtype
    try:
        yield
    finally:
        for c, forward in saved.items():
            c.forward = forward


def check_steps_match_peft(name, targets, dtype, grad_clip, tmp_path, device="cpu", steps=3, engine=EngineSection()):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    reference = hf_dense_model(name, seed)
    reference.save_pretrained(tmp_path / "hf")
    base = {n: p.detach().clone() for n, p in reference.named_parameters()}
    options = {"adam_eps": 1e-6} if dtype == "float32" else {"precision": "float64"}
    trainer, train = lora_trainer(
        tmp_path / "hf", tmp_path, targets, grad_clip, steps, device=device, engine=engine, **options
    )
    if dtype == "float64":
        reference = reference.double()
        reference.set_attn_implementation("sdpa")  # (transformers' eager attention takes its softmax in fp32)
    model = peft_model(reference, targets)
    with norms_in_input_dtype(model) if dtype == "float64" else contextlib.nullcontext():
        check_steps(trainer, train, model, grad_clip, seed)
    streamed = trainer.streamed_weights()
    for param_name, value in base.items():
        assert torch.equal(streamed[param_name].to(value.dtype), value), param_name
    trainer.close()


def check_steps(trainer, train, model, grad_clip, seed):
    generator = torch.Generator().manual_seed(seed)
    share_adapters(trainer, model, generator)
    optimizer = adapter_adamw(model, train)
    theirs = dict(model.named_parameters())
    tolerance = 1e-5 if trainer.compute_dtype == torch.float32 else 1e-10
    clipped = 0
    for step in range(train.steps):
        ids, labels = random_batch(train.batch_size, 12, trainer.model_config.vocab_size, generator)
        metrics = trainer.train_step(StepBatch(ids, labels))
        loss, norm = peft_step(model, optimizer, train, step, grad_clip, ids, labels)
        assert metrics.loss == pytest.approx(loss.item(), rel=tolerance)
        assert metrics.grad_norm == pytest.approx(norm.item(), rel=tolerance)
        clipped += bool(grad_clip) and norm.item() > grad_clip
        for adapter, view in trainer.named_weights().items():
            if ".lora_" in adapter:
                assert rel_err(view, theirs[peft_name(adapter)].detach()) < 10 * tolerance, (step, adapter)
    assert clipped or not grad_clip  # clipping really acts where on


@pytest.mark.parametrize(
    "name, targets, dtype, grad_clip",
    [
        ("tiny-qwen2", ["all-linear"], "float32", 0.05),
        ("tiny-qwen2", ["q_proj", "v_proj"], "float64", 0.0),
        ("tiny-phi3", ["all-linear"], "float64", 0.05),
        ("tiny-phi3", ["qkv_proj", "down_proj"], "float32", 0.0),
    ],
)
def test_steps_match_peft(name, targets, dtype, grad_clip, tmp_path):
    check_steps_match_peft(name, targets, dtype, grad_clip, tmp_path)
