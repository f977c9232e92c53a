"""GRPO steps against plain PyTorch + torch.optim.AdamW on fixed completions with given rewards: each token's
log-probability from the model's logits and TRL's GRPOTrainer loss written out here (apart from
megatrain_templates.objectives) for every loss type, with and without the KL term to a frozen reference, token- and
sequence-level importance sampling (GRPO, GSPO), one update per rollout and several (the old policy's
log-probabilities given); the reference's log-probabilities streamed from the store's reference copy of the initial
weights equal the frozen model's. float64 with the tests' own model (1e-10), float32 with transformers'. Fresh weights,
completions and rewards every run."""

import copy

import pytest
import torch
from reference_model import reference_adamw
from test_dpo import plain_model
from test_exactness import CASES, rel_err

from megatrain import Trainer
from megatrain.config import Config, GRPOSection, ModelSection, PrecisionSection, TrainSection
from megatrain.step import StepBatch
from megatrain_data import DataSection
from megatrain_optim import Schedule, lr_at
from megatrain_templates import Rollout, group_advantages

SEQ = 14


def random_groups(n_prompts: int, num_generations: int, vocab: int, generator: torch.Generator):
    """(input_ids, labels): n_prompts groups of num_generations rows sharing a prompt of 3-6 tokens (untrained),
    each ending in a completion of its own (trained), padded to SEQ."""
    rows = n_prompts * num_generations
    ids = torch.randint(0, vocab, (rows, SEQ), generator=generator)
    labels = torch.full_like(ids, -100)
    for group in range(n_prompts):
        prompt = int(torch.randint(3, 7, (), generator=generator))
        for row in range(group * num_generations, (group + 1) * num_generations):
            ids[row, :prompt] = ids[group * num_generations, :prompt]
            end = int(torch.randint(prompt + 2, SEQ + 1, (), generator=generator))
            labels[row, prompt - 1 : end - 1] = ids[row, prompt:end]
    return ids, labels


def token_logps(model, ids, labels, temperature=1.0):
    """Each position's log-probability of its label (0 where untrained), of the logits over the sampling temperature
    (TRL's _get_per_token_logps_and_entropies divides them by it)."""
    logits = (model.logits(ids) if hasattr(model, "logits") else model(input_ids=ids).logits) / temperature
    logps = logits.log_softmax(-1).gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return logps * (labels != -100)


def mean_entropy(model, ids, labels, temperature=1.0) -> float:
    """TRL's `entropy`: the next-token distribution's entropy (at the temperature), averaged over the trained
    positions."""
    with torch.no_grad():
        logits = (model.logits(ids) if hasattr(model, "logits") else model(input_ids=ids).logits) / temperature
        logps = logits.log_softmax(-1)
        return float(-(logps.exp() * logps).sum(-1)[labels != -100].mean())


def trl_loss(logps, old, ref, advantages, mask, grpo: GRPOSection):
    """TRL's GRPOTrainer._compute_loss, written out: [rows, seq] tensors, one micro-batch per step."""
    mask = mask.to(logps.dtype)
    log_ratio = logps - old
    if grpo.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_ratio)
    high = grpo.epsilon if grpo.epsilon_high is None else grpo.epsilon_high
    coef_2 = torch.clamp(coef_1, 1 - grpo.epsilon, 1 + high)
    per_token = -torch.min(coef_1 * advantages.unsqueeze(1), coef_2 * advantages.unsqueeze(1))
    if grpo.beta:  # (times the ratio: TRL's use_bias_correction_kl, its default since 1.10)
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        per_token = per_token + grpo.beta * (kl * coef_1 if grpo.use_bias_correction_kl else kl)
    if grpo.loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if grpo.loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.size(0) * grpo.max_completion_length)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def trl_advantages(rewards, num_generations, scale_rewards):
    grouped = rewards.view(-1, num_generations)
    advantages = rewards - grouped.mean(1).repeat_interleave(num_generations)
    if scale_rewards == "group":
        advantages = advantages / (grouped.std(1).repeat_interleave(num_generations) + 1e-4)
    elif scale_rewards == "batch":
        advantages = advantages / (rewards.std() + 1e-4)
    return advantages


CASES_GRPO = {
    "dapo": GRPOSection(num_generations=3, loss_type="dapo", epsilon_high=0.28),
    "grpo-kl": GRPOSection(num_generations=3, loss_type="grpo", beta=0.04),
    "grpo-kl-unweighted": GRPOSection(num_generations=3, loss_type="grpo", beta=0.04, use_bias_correction_kl=False),
    "bnpo-kl": GRPOSection(num_generations=3, loss_type="bnpo", beta=0.1, scale_rewards="batch"),
    "dr_grpo": GRPOSection(num_generations=3, loss_type="dr_grpo", scale_rewards="none", max_completion_length=12),
    "gspo": GRPOSection(num_generations=3, loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4),
    "gspo-kl": GRPOSection(num_generations=3, loss_type="dapo", importance_sampling_level="sequence", beta=0.04),
    # (the policy's, old policy's and reference's log-probabilities of logits over the sampling temperature)
    "grpo-kl-hot": GRPOSection(num_generations=3, loss_type="grpo", beta=0.04, temperature=0.7),
}


@pytest.mark.parametrize("dtype", list(CASES))
@pytest.mark.parametrize("case", list(CASES_GRPO))
@pytest.mark.parametrize("old", [False, True], ids=["one-update", "old-policy"])
def test_grpo_steps_equal_trl_formulas(dtype, case, old, tmp_path):
    check_grpo_steps(dtype, CASES_GRPO[case], tmp_path, micro_batch_size=2, with_old=old)


@pytest.mark.parametrize("micro_batch_size", [1, 6])  # every row its own micro-batch; the whole step in one
def test_grpo_micro_batches_give_the_step_of_one_batch(micro_batch_size, tmp_path):
    check_grpo_steps("float64", CASES_GRPO["grpo-kl"], tmp_path, micro_batch_size=micro_batch_size, with_old=True)


@pytest.mark.parametrize("case", ["grpo-kl", "grpo-kl-hot"])
def test_grpo_through_transformers_modules(case, tmp_path):
    """The generic template's head gives the same log-probabilities and entropies."""
    check_grpo_steps("float32", CASES_GRPO[case], tmp_path, 2, with_old=True, implementation="transformers")


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["grpo-kl", "gspo-kl", "grpo-kl-hot"])
def test_gpu_grpo_steps_equal_trl_formulas(case, tmp_path):
    """The CUDA engine (streams, the head's chunks) in float64 against the plain model on the GPU."""
    check_grpo_steps("float64", CASES_GRPO[case], tmp_path, micro_batch_size=2, with_old=True, device="cuda")


def grpo_trainer(dtype, grpo, tmp_path, rows, micro_batch_size, steps, seed, device, implementation):
    """(megatrain's GRPO Trainer of the tiny Llama, keeping its reference where the KL needs one, its TrainSection)."""
    train = TrainSection(
        steps=steps, batch_size=rows, micro_batch_size=micro_batch_size, lr=CASES[dtype][0], eps=1e-6,
        weight_decay=0.1, grad_clip=0.0, warmup_steps=1, seed=seed, objective="grpo", grpo=grpo,
    )  # fmt: skip
    config = Config(
        model=ModelSection(preset="tiny-llama", implementation=implementation),
        data=DataSection(seq_len=SEQ),
        train=train,
        precision=PrecisionSection(dtype),
        device=device,
        output_dir=str(tmp_path),
    )
    trainer = Trainer(config)
    if grpo.beta:  # (generated rollouts' reference: the initial weights, kept in the store and streamed per step)
        trainer.keep_reference()
    return trainer, train


def check_grpo_steps(
    dtype,
    grpo: GRPOSection,
    tmp_path,
    micro_batch_size,
    with_old,
    steps=3,
    n_prompts=2,
    device="cpu",
    implementation="auto",
):
    tolerance = CASES[dtype][1]
    seed = int(torch.randint(0, 2**31 - 1, ()))
    rows = n_prompts * grpo.num_generations
    trainer, train = grpo_trainer(dtype, grpo, tmp_path, rows, micro_batch_size, steps, seed, device, implementation)
    model = plain_model("tiny-llama", dtype, trainer.named_weights()).to(device)
    frozen = copy.deepcopy(model).eval()
    optimizer = reference_adamw(model, train)
    schedule = Schedule(train.lr, train.steps, train.warmup_steps, train.schedule, train.min_lr_ratio)
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        ids, labels = random_groups(n_prompts, grpo.num_generations, 256, generator)
        ids, labels = ids.to(device), labels.to(device)
        mask = labels != -100
        rewards = torch.rand(rows, generator=generator, dtype=torch.float64)
        advantages = trl_advantages(rewards, grpo.num_generations, grpo.scale_rewards)
        ours_advantages, _ = group_advantages(rewards, grpo.num_generations, grpo.scale_rewards)
        assert rel_err(ours_advantages, advantages) < 1e-12
        with torch.no_grad():
            ref = token_logps(frozen, ids, labels, grpo.temperature)
            # the sampling policy's: the current weights a little off (as after an earlier update of the rollout)
            old = (
                token_logps(model, ids, labels, grpo.temperature)
                + 0.05 * torch.randn(ids.shape, generator=generator).to(device) * mask
            )
        entropy = mean_entropy(model, ids, labels, grpo.temperature)  # (of the weights the step starts from)
        ours_ref = trainer.token_logps(StepBatch(ids.cpu(), labels.cpu()), reference=True) if grpo.beta else None
        if grpo.beta:  # (after a step, the current weights' would differ)
            assert rel_err(ours_ref, ref.cpu()) < tolerance
        rollout = Rollout(advantages, old.cpu() if with_old else None, ours_ref)
        metrics = trainer.train_step(StepBatch(ids.cpu(), labels.cpu(), extras=rollout))
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, schedule)
        optimizer.zero_grad()
        logps = token_logps(model, ids, labels, grpo.temperature)
        loss = trl_loss(logps, old if with_old else logps.detach(), ref, advantages.to(logps), mask, grpo)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        optimizer.step()
        assert metrics.loss == pytest.approx(loss.item(), rel=tolerance, abs=tolerance)
        assert metrics.grad_norm == pytest.approx(norm.item(), rel=10 * tolerance)
        assert {"clip_ratio/region_mean"} | ({"kl"} if grpo.beta else set()) <= set(metrics.as_dict())
        assert metrics.as_dict()["entropy"] == pytest.approx(entropy, rel=max(tolerance, 1e-6))  # (as recorded)
    ours = trainer.named_weights()
    for name, param in model.named_parameters():
        assert rel_err(ours[name], param.detach().cpu()) < 10 * tolerance, name
    trainer.close()


def test_a_temperature_on_soft_capped_logits_is_refused():
    """Dividing the head's rows divides its logits only where no soft cap (Gemma 2's) comes between."""
    from megatrain.config import ConfigError
    from megatrain.parts import tempered
    from megatrain_templates import Head

    with pytest.raises(ConfigError, match=r"train.grpo.temperature 0.7 on soft-capped logits .* set 1.0"):
        tempered(Head(64, 8, logit_softcap=30.0), 0.7)
    head = Head(64, 8)
    tempered(head, 0.7)
    assert head.temperature == 0.7
