"""Step-level objectives against the formulas written out per pair with autograd: the loss and each token's
coefficient (d loss / d its cross-entropy), pairs split across micro-batches, several sequences a row."""

import math

import pytest
import torch

from megatrain_templates import DPO, Sequences


def reference_loss(chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, loss_type, beta, eps, gamma):
    """The mean over pairs, each pair's loss from its completions' summed log-probabilities (written out per pair,
    as the papers state them; `chosen_tokens`: each chosen completion's trained tokens)."""
    losses = []
    for i in range(len(chosen)):
        n_c, n_r = chosen_tokens[i], chosen_tokens[len(chosen) + i]
        if loss_type in ("simpo", "orpo", "ipo"):
            c, r, rc, rr = chosen[i] / n_c, rejected[i] / n_r, ref_chosen[i] / n_c, ref_rejected[i] / n_r
        else:
            c, r, rc, rr = chosen[i], rejected[i], ref_chosen[i], ref_rejected[i]
        x = (c - rc) - (r - rr)
        if loss_type == "sigmoid":
            losses.append(-(1 - eps) * torch.log(torch.sigmoid(beta * x)) - eps * torch.log(torch.sigmoid(-beta * x)))
        elif loss_type == "robust":
            raw = -(1 - eps) * torch.log(torch.sigmoid(beta * x)) + eps * torch.log(torch.sigmoid(-beta * x))
            losses.append(raw / (1 - 2 * eps))
        elif loss_type == "hinge":
            losses.append(torch.clamp(1 - beta * x, min=0))
        elif loss_type == "ipo":
            losses.append((x - 1 / (2 * beta)) ** 2)
        elif loss_type == "simpo":
            losses.append(-torch.log(torch.sigmoid(beta * (c - r) - gamma)))
        elif loss_type == "orpo":
            odds = (c - torch.log(1 - torch.exp(c))) - (r - torch.log(1 - torch.exp(r)))
            losses.append(-beta * torch.log(torch.sigmoid(odds)))
    loss = torch.stack(losses).mean()
    if loss_type == "orpo":
        loss = loss - torch.stack(list(chosen)).sum() / sum(chosen_tokens[: len(chosen)])
    return loss


@pytest.mark.parametrize("loss_type", ["sigmoid", "robust", "hinge", "ipo", "simpo", "orpo"])
@pytest.mark.parametrize("packed", [False, True], ids=["a-row-each", "packed"])
def test_dpo_losses_and_token_coefficients_equal_the_formulas(loss_type, packed):
    torch.manual_seed(0)
    n_pairs, seq = 5, 9
    beta, eps, gamma = 0.3, 0.1 if loss_type in ("sigmoid", "robust") else 0.0, 0.7
    # per-token log-probabilities of 2 * n_pairs completions (chosen 2i, rejected 2i + 1), some tokens untrained
    owners = torch.arange(2 * n_pairs).repeat_interleave(seq).view(2 * n_pairs, seq)
    trained = torch.rand(2 * n_pairs, seq) < 0.7
    trained[:, 0] = True
    logps = (-torch.rand(2 * n_pairs, seq, dtype=torch.float64) * (0.1 if loss_type == "orpo" else 3)) * trained
    owners = torch.where(trained, owners, -1)
    if packed:  # two sequences a row: rows of 2 * seq tokens
        logps, owners = logps.view(n_pairs, 2 * seq), owners.view(n_pairs, 2 * seq)
    micro = [slice(0, 3), slice(3, None)]  # a pair's members across micro-batches where rows hold one each
    leaves = [logps[m].clone().requires_grad_(True) for m in micro]
    ref_sums = -torch.rand(2 * n_pairs, dtype=torch.float64) * 10
    lengths = trained.sum(-1).to(torch.float64)

    objective = DPO(beta, loss_type, eps, simpo_gamma=gamma)
    reference = Sequences(ref_sums, lengths) if loss_type not in ("simpo", "orpo") else None
    objective.begin_step([owners[m] for m in micro], reference)
    loss, coefficients = objective([leaf.detach() for leaf in leaves])

    sums = torch.zeros(2 * n_pairs, dtype=torch.float64)
    for leaf, m in zip(leaves, micro):
        sums = sums.index_add(0, owners[m].clamp_min(0).reshape(-1), (leaf * (owners[m] >= 0)).reshape(-1))
    expected = reference_loss(
        sums[0::2], sums[1::2], ref_sums[0::2], ref_sums[1::2], list(lengths[0::2]) + list(lengths[1::2]),
        loss_type, beta, eps, gamma,
    )  # fmt: skip
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    for coefficient, leaf in zip(coefficients, leaves):
        assert torch.allclose(coefficient, -leaf.grad, rtol=1e-10, atol=1e-14)
    assert 0 <= objective.metrics["rewards/accuracies"] <= 1
    assert math.isfinite(objective.metrics["rewards/margins"])


def test_reference_free_dpo_equals_a_reference_of_equal_scores():
    torch.manual_seed(1)
    logps = [-torch.rand(4, 6, dtype=torch.float64)]
    owners = [torch.arange(4).unsqueeze(1).expand(4, 6)]
    free = DPO(0.2, reference_free=True)
    free.begin_step(owners, Sequences(-torch.rand(4, dtype=torch.float64) * 5, torch.full((4,), 6.0)))
    constant = DPO(0.2)
    constant.begin_step(owners, Sequences(torch.full((4,), -3.0, dtype=torch.float64), torch.full((4,), 6.0)))
    (loss_free, coefficients_free), (loss_constant, coefficients_constant) = free(logps), constant(logps)
    assert loss_free.item() == pytest.approx(loss_constant.item(), rel=1e-12)
    assert torch.allclose(coefficients_free[0], coefficients_constant[0])
    assert free.metrics["rewards/chosen"] == pytest.approx(0.2 * float(logps[0][0::2].sum(-1).mean()))


def test_the_mean_is_over_every_processes_pairs():
    """With n_pairs given (all ranks' pairs), a rank's loss and coefficients are its share of the global mean."""
    logps = [-torch.rand(4, 5, dtype=torch.float64)]
    owners = [torch.arange(4).unsqueeze(1).expand(4, 5)]
    local, share = DPO(), DPO()
    local.begin_step(owners, None)
    share.begin_step(owners, None, n_pairs=8)
    (loss_local, coefficients_local), (loss_share, coefficients_share) = local(logps), share(logps)
    assert loss_share.item() == pytest.approx(loss_local.item() / 4)
    assert torch.allclose(coefficients_share[0], coefficients_local[0] / 4)


def test_a_margin_of_noise_is_a_tie_and_a_tie_is_not_right():
    """Policy = reference but for float32 noise (the first step): every pair ties, accuracy 0 (TRL's strict >
    would count the noise's sign); a chosen completion more likely by a real margin is right."""
    lengths = torch.tensor([9.0, 7.0, 12.0, 5.0])
    reference = Sequences(torch.tensor([-40.0, -35.0, -50.0, -20.0], dtype=torch.float64), lengths)
    objective = DPO(0.1, "sigmoid")
    real = [0.005, 0.0, 0.0, 2e-6]  # (a margin of 5e-4 at beta 0.1: a tie by the 1e-4 tolerance, against TRL)
    for shift, accuracy in (([2e-6, -2e-6, 1e-6, -3e-6], 0.0), ([0.5, 0.0, 0.0, 2e-6], 0.5), (real, 0.5)):
        objective.begin_step([], reference, n_pairs=2)
        _, metrics = objective.loss(Sequences(reference.logps + torch.tensor(shift, dtype=torch.float64), lengths))
        assert metrics["rewards/accuracies"].item() == accuracy


def test_orpos_log_of_one_minus_the_odds_is_stable_near_zero():
    """log(1 - e^p) of a completion's mean log-probability p: log1p(-exp(p)) in fp32 was 1% off at -1e-7 and infinite
    above -3e-8 (a completion the policy is sure of); the value and its gradient now follow float64's."""
    from megatrain_templates.objectives import _log1mexp

    p = torch.tensor([-3e-8, -1e-7, -0.5, -0.7, -1.0, -30.0], dtype=torch.float32, requires_grad=True)
    _log1mexp(p).sum().backward()
    exact = torch.log(-torch.expm1(p.detach().double()))
    slope = torch.exp(p.detach().double()) / torch.expm1(p.detach().double())
    assert torch.allclose(_log1mexp(p.detach()).double(), exact, rtol=1e-6, atol=1e-6)
    assert torch.allclose(p.grad.double(), slope, rtol=1e-5)


def test_a_step_of_other_micro_batches_than_begin_step_was_told_of_is_refused_naming_it():
    """A custom trainer that forgot begin_step (or told it of other micro-batches): one message naming the call, not
    an index error deep in the objective."""
    from megatrain_templates import GRPO

    logps = [-torch.rand(2, 5, dtype=torch.float64), -torch.rand(2, 5, dtype=torch.float64)]
    for objective in (DPO(), GRPO(beta=0.0)):
        with pytest.raises(ValueError, match=r"told of micro-batches \[\] \(begin_step or start_step\), the step ran"):
            objective(logps)
    dpo = DPO()
    dpo.begin_step([torch.arange(2).unsqueeze(1).expand(2, 5)], None)
    with pytest.raises(ValueError, match=r"told of micro-batches \[\(2, 5\)\]"):
        dpo(logps)
