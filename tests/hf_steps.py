"""What the tests that train against transformers share: megatrain's trainer on a Hugging Face directory,
torch's AdamW with megatrain's weight-decay rule, random batches and transformers' label convention."""

import torch

from megatrain import Trainer
from megatrain.config import Config, DataSection, EngineSection, ModelSection, PrecisionSection, TrainSection
from megatrain_optim import Schedule, lr_at

NO_DECAY = ("norm.weight", ".bias", "_bias", "sinks")  # megatrain's rule: no weight decay on norms, biases, sinks


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def make_trainer(
    hf_dir,
    tmp_path,
    grad_clip,
    steps,
    batch_size=6,
    micro_batch_size=2,
    device="cpu",
    engine=EngineSection(),
    router_bias_update_rate=0.0,
    router_seq_aux_loss_coef=0.0,
    router_z_loss_coef=0.0,
):
    train = TrainSection(
        steps=steps,
        batch_size=batch_size,
        micro_batch_size=micro_batch_size,
        lr=1e-4,  # fp32 noise in near-zero gradients (e.g. k_proj.bias) stays well under the tolerance
        weight_decay=0.1,
        grad_clip=grad_clip,
        warmup_steps=1,
        schedule="cosine",
        router_bias_update_rate=router_bias_update_rate,
        router_seq_aux_loss_coef=router_seq_aux_loss_coef,
        router_z_loss_coef=router_z_loss_coef,
    )
    config = Config(
        model=ModelSection(hf_dir=str(hf_dir)),
        data=DataSection(seq_len=12),
        train=train,
        precision=PrecisionSection("float32"),
        engine=engine,
        device=device,
        output_dir=str(tmp_path / "run"),
    )
    return Trainer(config), train


def hf_adamw(model, train):
    params = dict(model.named_parameters())
    no_decay = [p for n, p in params.items() if n.endswith(NO_DECAY)]
    decay = [p for n, p in params.items() if not n.endswith(NO_DECAY)]
    groups = [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=train.lr, betas=train.betas, eps=train.eps)


def random_batch(batch, seq, vocab, generator):
    ids = torch.randint(0, vocab, (batch, seq), generator=generator)
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[torch.rand(batch, seq, generator=generator) < 0.2] = -100
    return ids, labels


def hf_labels(labels):
    """megatrain's labels hold the next token at each position; transformers shifts by itself."""
    return torch.cat([torch.full_like(labels[:, :1], -100), labels[:, :-1]], dim=1)


def reference_step(model, optimizer, train, step: int, grad_clip: float, extra_loss=None, **inputs):
    """One optimizer step of transformers' `model` as megatrain takes step `step` of `train`: its learning rate,
    the loss (plus `extra_loss()`, where given) on `inputs` (megatrain's labels, shifted here), clipping at
    `grad_clip` (0: none). Returns (the model's output, the loss stepped on, the gradient norm before clipping)."""
    schedule = Schedule(train.lr, train.steps, train.warmup_steps, train.schedule, train.min_lr_ratio)
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, schedule)
    optimizer.zero_grad()
    out = model(**{**inputs, "labels": hf_labels(inputs["labels"])})
    loss = out.loss if extra_loss is None else out.loss + extra_loss()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float("inf"))
    optimizer.step()
    return out, loss, norm


def check_text_model_trains_and_exports_alone(hf_dir, tmp_path, capfd, config, expected_logits, ids, text_class):
    """An image-text checkpoint in `hf_dir` whose text model is `config`: megatrain reads the text model and says
    it leaves the rest out, computes `expected_logits` on `ids`, and exports a `text_class` (as does `megatrain
    convert`) with the same logits."""
    import transformers

    from megatrain.cli import main

    trainer, _ = make_trainer(hf_dir, tmp_path, 0.0, steps=1)
    assert "leaving out" in capfd.readouterr().err
    assert trainer.model_config == config.with_changes(initializer_range=trainer.model_config.initializer_range)
    assert rel_err(trainer.logits(ids), expected_logits) < 1e-5
    exported = trainer.export(tmp_path / "out")
    trainer.close()
    converted = tmp_path / "converted"
    assert main(["convert", str(hf_dir), str(converted), "--dtype", "float32"]) == 0
    for directory in (exported, converted):
        text_model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        assert type(text_model).__name__ == text_class
        with torch.no_grad():
            assert rel_err(text_model(ids).logits, expected_logits) < 1e-5
