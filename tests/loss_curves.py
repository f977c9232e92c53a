"""Train the same small model on real text with megatrain and with plain PyTorch (autocast,
fp32 master weights, torch.optim.AdamW) and return both loss curves.

The default lr (1e-3) keeps the two bf16 trajectories comparable over 200 steps: at 3e-3
both stay within ~0.6% of the fp32 curve for 120 steps, but the two bf16 variants (bf16
residual stream in megatrain, fp32 residual under autocast) then drift apart chaotically,
by up to ~1.5% per step, with neither systematically closer to fp32."""

import torch
from reference_model import ReferenceLM, reference_adamw

from megatrain import Trainer
from megatrain.config import Config, ModelSection, PrecisionSection, TrainSection
from megatrain.step import StepBatch
from megatrain_data import DataSection, TokenWindows, load_token_array
from megatrain_optim import Schedule, lr_at


def loss_curves(device, dtype, steps, batch_size, seq_len, workdir, lr=1e-3):
    train = TrainSection(
        steps=steps,
        batch_size=batch_size,
        micro_batch_size=batch_size // 2,
        lr=lr,
        warmup_steps=steps // 10,
        schedule="cosine",
        weight_decay=0.1,
        grad_clip=1.0,
        seed=0,
    )
    config = Config(
        model=ModelSection(preset="small-llama"),
        data=DataSection(seq_len=seq_len),
        train=train,
        precision=PrecisionSection(dtype),
        device=device,
        output_dir=str(workdir),
    )
    trainer = Trainer(config)
    tokens, _ = load_token_array(config.data, trainer.model_config.vocab_size, workdir / "cache", None)
    windows = TokenWindows(tokens, seq_len, batch_size, shuffle=True, seed=0)
    reference = ReferenceLM(trainer.model_config).to(device)
    reference.load_named({k: v.clone() for k, v in trainer.named_weights().items()})
    optimizer = reference_adamw(reference, train)
    schedule = Schedule(train.lr, train.steps, train.warmup_steps, train.schedule, train.min_lr_ratio)
    ours, theirs = [], []
    autocast_dtype = getattr(torch, dtype)
    for step in range(steps):
        batch = windows.batch(step)
        ids, labels = batch.input_ids, batch.labels
        ours.append(trainer.train_step(StepBatch(ids, labels)).loss)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, schedule)
        optimizer.zero_grad()
        with torch.autocast(
            device_type=torch.device(device).type, dtype=autocast_dtype, enabled=autocast_dtype != torch.float32
        ):
            loss = reference.loss(ids.to(device), labels.to(device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), train.grad_clip)
        optimizer.step()
        theirs.append(loss.item())
    trainer.close()
    return ours, theirs
