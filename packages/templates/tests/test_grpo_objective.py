"""The GRPO objective against TRL 1.16's GRPOTrainer._compute_loss written out here: the KL term's importance-ratio
weighting (use_bias_correction_kl) and the clip-ratio metrics of sequence-level importance sampling (GSPO)."""

import pytest
import torch

from megatrain_templates import GRPO


def rollout(generator: torch.Generator):
    """Two micro-batches of 3 rows x 6 positions: some positions untrained (-1), each row's tokens its sequence."""
    trained = torch.rand(2, 3, 6, generator=generator) < 0.7
    trained[..., 0] = True  # (every row trains a token)
    rows = torch.arange(6).view(2, 3, 1).expand(2, 3, 6)
    sequence_of = [torch.where(trained[m], rows[m], -1) for m in range(2)]
    logps = [-torch.rand(3, 6, generator=generator, dtype=torch.float64) for _ in range(2)]
    shift = lambda: 0.3 * torch.randn(6, 6, generator=generator, dtype=torch.float64)  # noqa: E731
    old, ref = torch.cat(logps) + shift(), torch.cat(logps) + shift()
    advantages = torch.randn(6, generator=generator, dtype=torch.float64)
    return sequence_of, logps, old, ref, advantages, torch.cat([t >= 0 for t in sequence_of]).double()


def trl_loss(logps, old, ref, advantages, mask, beta, bias_correction, level="token", eps=0.2):
    """TRL 1.16's dapo loss on [rows, seq] tensors (one micro-batch), and its kl and clip-ratio metrics."""
    log_ratio = logps - old
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1)).unsqueeze(-1)
    coef_1 = torch.exp(log_ratio)
    kl = torch.exp(ref - logps) - (ref - logps) - 1
    if bias_correction:
        kl = kl * coef_1
    coef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps)
    per_token = -torch.min(coef_1 * advantages[:, None], coef_2 * advantages[:, None]) + beta * kl
    loss = (per_token * mask).sum() / mask.sum()
    clipped = ((coef_1 < 1 - eps) & (advantages[:, None] < 0)) | ((coef_1 > 1 + eps) & (advantages[:, None] > 0))
    weights = mask if level == "token" else torch.ones_like(clipped, dtype=mask.dtype)  # (GSPO: per sequence)
    metrics = {
        "kl": (kl * mask).sum() / mask.sum(),
        "clip_ratio/region_mean": (clipped * weights).sum() / weights.sum(),
    }
    return loss, metrics


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("old_policy", [False, True], ids=["one-update", "old-policy"])
def test_the_kl_term_is_weighted_by_the_importance_ratio_as_trls(bias_correction, old_policy):
    """TRL (since 1.10, by default) multiplies the k3 KL by the importance ratio: on a rollout's first update the
    ratio is 1, the loss the same, but its gradient adds the KL's own (megatrain's ignored it: the step moved
    otherwise than TRL's wherever beta > 0)."""
    sequence_of, logps, old, ref, advantages, mask = rollout(torch.Generator().manual_seed(0))
    objective = GRPO(beta=0.1, loss_type="dapo", use_bias_correction_kl=bias_correction)
    objective.begin_step(sequence_of, advantages, old if old_policy else None, ref)
    loss, scales = objective(logps)
    policy = torch.cat(logps).requires_grad_(True)
    trl, metrics = trl_loss(policy, old if old_policy else policy.detach(), ref, advantages, mask, 0.1, bias_correction)
    (gradient,) = torch.autograd.grad(trl, policy)
    assert loss.item() == pytest.approx(trl.item(), rel=1e-12)
    assert torch.allclose(-torch.cat(scales), gradient * mask, rtol=1e-10, atol=1e-14)
    assert objective.metrics["kl"] == pytest.approx(metrics["kl"].item(), rel=1e-12)


def test_gspos_clip_ratios_are_shares_of_sequences_as_trls():
    """Sequence-level importance sampling clips whole sequences: TRL logs the share of sequences clipped;
    megatrain's counted each sequence's tokens, so a long clipped sequence weighed more (0.09 apart on a toy run)."""
    sequence_of, logps, old, ref, advantages, mask = rollout(torch.Generator().manual_seed(1))
    objective = GRPO(loss_type="dapo", importance_sampling_level="sequence", epsilon=0.05)
    objective.begin_step(sequence_of, advantages, old)
    objective(logps)
    _, metrics = trl_loss(torch.cat(logps), old, ref, advantages, mask, 0.0, False, "sequence", eps=0.05)
    assert 0 < metrics["clip_ratio/region_mean"] < 1
    assert objective.metrics["clip_ratio/region_mean"] == pytest.approx(metrics["clip_ratio/region_mean"].item())
