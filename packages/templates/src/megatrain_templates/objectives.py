"""Step-level objectives: a loss over the log-probabilities the head gives each token of a step, turned into the
coefficient of every token's cross-entropy, which the head's backward applies (`Head.loss` with a tensor scale).

The pipeline calls an objective once per training step, at the head, with every micro-batch's token
log-probabilities (`Head.token_logps`), before any backward: the loss may couple any sequences of the step (a
preference pair's chosen and rejected, a prompt's group of completions). `SequenceObjective` sums the tokens per
sequence, differentiates its subclass's `loss` of those sums by autograd, and spreads each sequence's coefficient
over its tokens (see `DPO`); `TokenObjective` differentiates its subclass's `loss` of the trained tokens'
log-probabilities themselves (see `GRPO`): a new objective is a `loss` of a page.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class Sequences:
    """A step's sequences as the head scores them: the summed log-probability of each one's trained tokens
    ([n_sequences], differentiable inside an objective's `loss`) and how many trained tokens each has."""

    logps: Tensor
    lengths: Tensor

    @property
    def mean_logps(self) -> Tensor:
        """Per-token average log-probability (SimPO's, IPO's and ORPO's length-normalised scores)."""
        return self.logps / self.lengths.clamp_min(1)


class Objective:
    """What the pipeline calls at the head of a training step: `objective(token_logps, token_entropy) -> (loss,
    scales)`, every micro-batch's token log-probabilities (and, where it `wants_entropy`, each position's entropy of
    the head's distribution; else None) in, the step's loss and each token's d loss / d its cross-entropy out.
    Before a step, `begin_step(sequence_of)` says which sequence each trained token belongs to: per micro-batch a
    [rows, seq] int64 tensor, -1 where a token is not trained (its label is -100). `metrics` are the last step's,
    means over its `metrics_weight` sequences or tokens (so that several ranks' combine)."""

    wants_entropy = False  # True: the head gives `token_entropy` too, per micro-batch each position's entropy

    def __init__(self):
        self.sequence_of: list[Tensor] = []
        self.n_sequences = 0
        self.metrics: dict[str, float] = {}
        self.metrics_weight = 0  # what the metrics are means over: the step's sequences or trained tokens

    def begin_step(self, sequence_of: list[Tensor]) -> None:
        """Tell the objective the next step's micro-batches, before the pipeline runs it (by `start_step`, or
        directly where no trainer shares the step): `sequence_of` per micro-batch a [rows, seq] int64 tensor of each
        label's sequence (0 to n_sequences - 1 over these micro-batches), -1 where it is not trained.
        Subclasses take the step's other inputs here as keywords."""
        self.sequence_of = sequence_of
        self.n_sequences = max(int(s.max()) for s in sequence_of) + 1 if sequence_of else 0

    def start_step(self, sequence_of: list[Tensor], extras: object, mine: slice, lengths: Tensor) -> None:
        """What a trainer calls before a step: `sequence_of` as `begin_step` takes it (this process's sequences),
        `extras` what the objective needs of the step's rows beside their tokens (this one: nothing), `mine` this
        process's sequences among the step's, `lengths` [n_sequences] the trained tokens of each of the step's
        sequences (every process's)."""
        self.begin_step(sequence_of)

    def __call__(
        self, token_logps: list[Tensor], token_entropy: list[Tensor] | None = None
    ) -> tuple[Tensor, list[Tensor]]:
        raise NotImplementedError

    def _check_step(self, token_logps: list[Tensor]) -> None:
        """Refuse a step whose micro-batches are not the ones `begin_step` was told of (a deep index error after)."""
        told, ran = [tuple(s.shape) for s in self.sequence_of], [tuple(t.shape) for t in token_logps]
        if told != ran:
            raise ValueError(
                f"the objective was told of micro-batches {told} (begin_step or start_step), the step ran {ran}: call "
                "begin_step with each step's micro-batches first"
            )


class SequenceObjective(Objective):
    """A loss of the step's per-sequence log-probabilities: subclasses implement `loss(policy) -> (loss, metrics)`."""

    def loss(self, policy: Sequences) -> tuple[Tensor, dict[str, Tensor]]:
        """What a subclass implements: (the step's loss, a 0-d tensor differentiable in `policy.logps` [n_sequences],
        metrics name -> 0-d tensor). Called once per step, inside `__call__` with grad enabled."""
        raise NotImplementedError

    def __call__(
        self, token_logps: list[Tensor], token_entropy: list[Tensor] | None = None
    ) -> tuple[Tensor, list[Tensor]]:
        """The pipeline's hook: (the step's loss, per micro-batch each token's d loss / d its cross-entropy)."""
        self._check_step(token_logps)
        device, dtype = token_logps[0].device, token_logps[0].dtype
        sums = torch.zeros(self.n_sequences, dtype=dtype, device=device)
        lengths = torch.zeros(self.n_sequences, dtype=dtype, device=device)
        owners = []
        for logps, sequence_of in zip(token_logps, self.sequence_of):
            owner = sequence_of.to(device)
            trained = owner >= 0
            owner = torch.where(trained, owner, self.n_sequences)  # an extra bin for tokens of no sequence
            owners.append(owner)
            padded = torch.zeros(self.n_sequences + 1, dtype=dtype, device=device)
            sums += padded.index_add(0, owner.reshape(-1), logps.reshape(-1))[:-1]
            lengths += padded.index_add(0, owner.reshape(-1), trained.reshape(-1).to(dtype))[:-1]
        with torch.enable_grad():
            policy = Sequences(sums.detach().requires_grad_(True), lengths)
            loss, metrics = self.loss(policy)
            (coefficient,) = torch.autograd.grad(loss, policy.logps)
        self.metrics = {name: float(value) for name, value in metrics.items()}
        self.metrics_weight = self.n_sequences
        # d loss / d(token cross-entropy) = -d loss / d(token log-probability), per sequence; 0 for none
        per_token = torch.cat([-coefficient, coefficient.new_zeros(1)])
        return loss.detach(), [per_token[owner] for owner in owners]


class TokenObjective(Objective):
    """A loss of the step's trained tokens' log-probabilities, flat in step order (micro-batch, row, position):
    subclasses implement `loss(logps) -> (loss, metrics)`; `owner` holds each token's sequence, `lengths` each
    sequence's trained tokens."""

    def begin_step(self, sequence_of: list[Tensor]) -> None:
        """As `Objective.begin_step`, and sets `owner` [trained tokens] (each one's sequence, in step order) and
        `lengths` [n_sequences] (each sequence's trained tokens) for `loss`."""
        super().begin_step(sequence_of)
        self.owner = torch.cat([s[s >= 0] for s in sequence_of]) if sequence_of else torch.zeros(0, dtype=torch.long)
        self.lengths = torch.bincount(self.owner, minlength=self.n_sequences)

    def loss(self, logps: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """What a subclass implements: `logps` [trained tokens], the step's trained tokens' log-probabilities in step
        order (as `owner`); (the step's loss, a 0-d tensor differentiable in `logps`, metrics name -> 0-d tensor).
        Called once per step, inside `__call__` with grad enabled."""
        raise NotImplementedError

    def __call__(
        self, token_logps: list[Tensor], token_entropy: list[Tensor] | None = None
    ) -> tuple[Tensor, list[Tensor]]:
        """The pipeline's hook: (the step's loss, per micro-batch each token's d loss / d its cross-entropy, 0 where
        not trained); `token_entropy`, where given, adds the trained tokens' mean entropy to the metrics."""
        self._check_step(token_logps)
        device = token_logps[0].device
        trained = [owner.to(device) >= 0 for owner in self.sequence_of]
        flat = torch.cat([logps[mask] for logps, mask in zip(token_logps, trained)])
        with torch.enable_grad():
            leaf = flat.detach().requires_grad_(True)
            loss, metrics = self.loss(leaf)
            (coefficient,) = torch.autograd.grad(loss, leaf)
        if token_entropy is not None:  # (TRL's `entropy`: the mean over the trained tokens)
            metrics["entropy"] = torch.cat([e[mask] for e, mask in zip(token_entropy, trained)]).mean()
        self.metrics = {name: float(value) for name, value in metrics.items()}
        self.metrics_weight = len(flat)
        scales, start = [], 0
        for logps, mask in zip(token_logps, trained):
            scale = torch.zeros_like(logps)
            scale[mask] = -coefficient[start : start + int(mask.sum())]  # (d loss / d cross-entropy)
            start += int(mask.sum())
            scales.append(scale)
        return loss.detach(), scales


REFERENCE_FREE_LOSSES = ("simpo", "orpo")  # (SimPO and ORPO score each completion by itself, no reference)


class DPO(SequenceObjective):
    """Direct preference optimisation and its family over pairs: sequence 2i is pair i's chosen completion, 2i + 1
    its rejected one (the prompt's tokens are not trained, so each sum is the completion's log-probability). The
    loss is the mean over the step's pairs (`n_pairs`, all processes'), as TRL's DPOTrainer, CPOTrainer (SimPO)
    and ORPOTrainer compute it; `reference` are the reference model's sums for the same sequences (None for the
    reference-free losses). Metrics as TRL names them."""

    def __init__(
        self,
        beta: float = 0.1,
        loss_type: str = "sigmoid",
        label_smoothing: float = 0.0,
        reference_free: bool = False,
        simpo_gamma: float = 0.5,
    ):
        super().__init__()
        self.beta, self.loss_type, self.label_smoothing = beta, loss_type, label_smoothing
        self.reference_free, self.simpo_gamma = reference_free, simpo_gamma
        self.reference: Sequences | None = None
        self.n_pairs = self.chosen_tokens = 0

    def begin_step(
        self, sequence_of: list[Tensor], reference: Sequences | None = None, n_pairs: int = 0, chosen_tokens: int = 0
    ) -> None:
        """`reference`: the reference model's summed log-probabilities of the step's sequences (and lengths);
        `n_pairs`: the pairs the loss averages over, `chosen_tokens` their chosen completions' trained tokens (ORPO's
        NLL is their mean) (0: this step's)."""
        super().begin_step(sequence_of)
        self.reference, self.n_pairs = reference, n_pairs or self.n_sequences // 2
        self.chosen_tokens = chosen_tokens

    @property
    def needs_reference(self) -> bool:
        """Whether the loss compares with the reference model's scores."""
        return not self.reference_free and self.loss_type not in REFERENCE_FREE_LOSSES

    def start_step(self, sequence_of: list[Tensor], extras: Sequences | None, mine: slice, lengths: Tensor) -> None:
        """`extras`: the reference's scores of every sequence of the step (None where the loss needs none)."""
        if extras is not None:
            extras = Sequences(extras.logps[mine], extras.lengths[mine])
        elif self.needs_reference:
            raise ValueError(
                "train.dpo.loss_type needs the reference model's log-probabilities: give them as the step's extras"
            )
        self.begin_step(sequence_of, extras, n_pairs=len(lengths) // 2, chosen_tokens=int(lengths[0::2].sum()))

    def loss(self, policy: Sequences) -> tuple[Tensor, dict[str, Tensor]]:
        """The `loss_type`'s loss of `policy` (pairs interleaved, chosen first) summed over this process's pairs /
        `n_pairs` (ORPO's NLL over `chosen_tokens`), and TRL's pair metrics (means over this process's pairs)."""
        if self.loss_type == "orpo":
            return self._orpo(policy)
        if self.loss_type == "simpo":
            return self._simpo(policy)
        average = self.loss_type == "ipo"  # (TRL's IPO scores each completion by its mean log-probability)
        scores = policy.mean_logps if average else policy.logps
        if self.reference is None or self.reference_free:
            reference = torch.zeros_like(scores)
        else:
            reference = self.reference.mean_logps if average else self.reference.logps
            reference = reference.to(scores)
        chosen, rejected = scores[0::2] - reference[0::2], scores[1::2] - reference[1::2]
        losses = dpo_losses(chosen - rejected, self.beta, self.loss_type, self.label_smoothing)
        rewards = self.beta * chosen.detach(), self.beta * rejected.detach()
        return losses.sum() / self.n_pairs, _pair_metrics(scores.detach(), *rewards, self.beta)

    def _simpo(self, policy: Sequences) -> tuple[Tensor, dict[str, Tensor]]:
        """SimPO (Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward", eq. 6):
        -log sigmoid(beta (mean logp_chosen - mean logp_rejected) - gamma), label smoothing as cDPO's. TRL's
        CPOTrainer adds cpo_alpha x the chosen completions' cross-entropy by default; the paper's SimPO does not."""
        scores = policy.mean_logps
        margin = scores[0::2] - scores[1::2] - self.simpo_gamma / self.beta
        losses = dpo_losses(margin, self.beta, "sigmoid", self.label_smoothing)
        rewards = self.beta * scores[0::2].detach(), self.beta * scores[1::2].detach()
        return losses.sum() / self.n_pairs, _pair_metrics(scores.detach(), *rewards, self.beta)

    def _orpo(self, policy: Sequences) -> tuple[Tensor, dict[str, Tensor]]:
        """ORPO (Hong et al. 2024, "ORPO: Monolithic Preference Optimization without Reference Model", eq. 6-7): the
        chosen completions' cross-entropy (mean over their tokens) minus beta x the mean over pairs of
        log sigmoid(log odds(chosen) - log odds(rejected)), each odds of the completion's mean log-probability p:
        p - log(1 - e^p)."""
        scores = policy.mean_logps
        chosen, rejected = scores[0::2], scores[1::2]
        log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
        chosen_tokens = self.chosen_tokens or policy.lengths[0::2].sum()  # (every process's: one mean over the step)
        nll = -policy.logps[0::2].sum() / chosen_tokens
        loss = nll - self.beta * F.logsigmoid(log_odds).sum() / self.n_pairs
        metrics = _pair_metrics(scores.detach(), self.beta * chosen.detach(), self.beta * rejected.detach(), self.beta)
        return loss, metrics | {"nll_loss": nll.detach(), "log_odds_ratio": F.logsigmoid(log_odds).detach().mean()}


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 - e^x) for x < 0, stable at both ends (Maechler 2012): log(-expm1(x)) near 0, where log1p(-exp(x)) in
    fp32 was 1% off at -1e-7 and infinite above -3e-8; log1p(-exp(x)) below -ln 2."""
    near = x > -0.6931471805599453  # (each side computed where it is taken: the other's inf would make NaN gradients)
    far = torch.log1p(-torch.exp(torch.where(near, -1.0, x)))
    return torch.where(near, torch.log(-torch.expm1(torch.where(near, x, -1.0))), far)


def dpo_losses(logits: Tensor, beta: float, loss_type: str, label_smoothing: float = 0.0) -> Tensor:
    """Each pair's loss of `logits` = (policy - reference) log-ratio of chosen over rejected, as TRL's dpo_loss:

    - sigmoid: DPO (Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly a Reward
      Model", eq. 7); with label_smoothing eps, cDPO (Mitchell 2023, "A note on DPO with noisy preferences", eq. 3):
      -(1 - eps) log sigmoid(beta x) - eps log sigmoid(-beta x)
    - robust: Chowdhury et al. 2024, "Provably Robust DPO", eq. 8:
      (-(1 - eps) log sigmoid(beta x) + eps log sigmoid(-beta x)) / (1 - 2 eps)
    - hinge: the SLiC / RSO hinge (Liu et al. 2023, "Statistical Rejection Sampling Improves Preference
      Optimization", eq. 9): max(0, 1 - beta x)
    - ipo: Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human Preferences", eq. 17:
      (x - 1 / (2 beta))^2, beta the paper's tau
    """
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    if loss_type == "robust":
        flipped = F.logsigmoid(-beta * logits) * label_smoothing
        return (-F.logsigmoid(beta * logits) * (1 - label_smoothing) + flipped) / (1 - 2 * label_smoothing)
    if loss_type == "hinge":
        return torch.relu(1 - beta * logits)
    if loss_type == "ipo":
        return (logits - 1 / (2 * beta)) ** 2
    raise ValueError(f"unknown DPO loss type {loss_type!r}")


# a reward margin within this share of the pair's log-probabilities (times beta) is a tie: the noise of computing
# them twice (policy = reference at the first step gives margins of +-2e-6 on the CPU in float32, not 0; float32's
# rounding is 1.2e-7 of a value). 1e-4 also took real margins of a few thousandths for ties (0.0028 at a second
# step, where TRL's accuracy was 0.25 and this one's 0)
TIE_TOLERANCE = 1e-5


def _pair_metrics(scores: Tensor, chosen_rewards: Tensor, rejected_rewards: Tensor, beta: float) -> dict[str, Tensor]:
    """TRL's metrics of a step's pairs: the rewards' means, accuracy and margin, the completions' scores. A pair is
    right where its chosen reward beats the rejected one by more than `TIE_TOLERANCE`: a tie is not right (TRL's
    strict > counts noise as half right)."""
    noise = TIE_TOLERANCE * beta * (scores[0::2].abs() + scores[1::2].abs())
    return {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards - rejected_rewards > noise).to(scores.dtype).mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": scores[0::2].mean(),
        "logps/rejected": scores[1::2].mean(),
    }


GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


@dataclass
class Rollout:
    """What GRPO needs of a step's rows beside their tokens: each row's advantage ([rows]) and, per token ([rows,
    seq], as the labels), the log-probabilities under the policy that sampled it (None: the current one, a single
    update per rollout) and under the reference (None: no KL term)."""

    advantages: Tensor
    old_logps: Tensor | None = None
    ref_logps: Tensor | None = None

    def rows(self, rows: slice) -> "Rollout":
        """These rows' part (a process's share of the step)."""
        return Rollout(*(None if t is None else t[rows] for t in (self.advantages, self.old_logps, self.ref_logps)))


class GRPO(TokenObjective):
    """Group relative policy optimisation (Shao et al. 2024, "DeepSeekMath", eq. 3) with TRL's GRPOTrainer options
    and names: each completion's tokens weighted by its `advantage`, the importance ratio to the policy that sampled
    it (`old_logps`; None: this policy, one update per rollout) clipped to [1 - epsilon, 1 + epsilon_high] per token,
    or per sequence as GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", eq. 7: the ratio of the
    sequences' mean token log-probabilities), plus `beta` x the k3 estimate of the KL divergence to the reference
    per token (Schulman 2020, "Approximating KL divergence": e^(ref - logp) - (ref - logp) - 1), times the importance
    ratio where `use_bias_correction_kl` (TRL's default since 1.10: DeepSeek-V3.2's unbiased KL gradient; the ratio,
    1 at a rollout's first update, still carries a gradient there). The tokens' losses
    aggregate as TRL's `loss_type`: grpo, the mean over sequences of each one's token mean; bnpo and dapo, the mean
    over the step's tokens (TRL's bnpo normalises per micro-batch: the same with one per step); dr_grpo (Liu et al.
    2025, "Understanding R1-Zero-Like Training"), the sum over the step's tokens / (sequences x
    `max_completion_length`). Normalisers count the whole step (every process's), so processes' losses add up."""

    wants_entropy = True

    def __init__(
        self,
        beta: float = 0.0,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        loss_type: str = "dapo",
        importance_sampling_level: str = "token",
        max_completion_length: int = 256,
        use_bias_correction_kl: bool = True,
    ):
        super().__init__()
        if loss_type not in GRPO_LOSS_TYPES:
            raise ValueError(f"unknown GRPO loss type {loss_type!r}; one of {GRPO_LOSS_TYPES}")
        if importance_sampling_level not in ("token", "sequence"):
            raise ValueError(f"importance_sampling_level must be token or sequence, got {importance_sampling_level!r}")
        self.beta, self.loss_type, self.level = beta, loss_type, importance_sampling_level
        self.epsilon_low, self.epsilon_high = epsilon, epsilon if epsilon_high is None else epsilon_high
        self.max_completion_length = max_completion_length
        self.use_bias_correction_kl = use_bias_correction_kl

    def begin_step(
        self,
        sequence_of: list[Tensor],
        advantages: Tensor,
        old_logps: Tensor | None = None,
        ref_logps: Tensor | None = None,
        n_sequences: int = 0,
        n_tokens: int = 0,
    ) -> None:
        """`advantages` per sequence; `old_logps`, `ref_logps` [sequences, seq] per token of the rows (as the
        micro-batches' rows, back to back), or None; `n_sequences`, `n_tokens`: the whole step's (0: these)."""
        super().begin_step(sequence_of)
        trained = torch.cat([s >= 0 for s in sequence_of]) if sequence_of else None
        self.advantages = advantages
        self.old = None if old_logps is None else old_logps[trained]
        self.ref = None if ref_logps is None else ref_logps[trained]
        self.total_sequences = n_sequences or self.n_sequences
        self.total_tokens = n_tokens or int(self.lengths.sum())
        if self.beta and self.ref is None:
            raise ValueError("GRPO with beta > 0 needs the reference's token log-probabilities (ref_logps)")

    def start_step(self, sequence_of: list[Tensor], extras: Rollout | None, mine: slice, lengths: Tensor) -> None:
        """`extras`: the `Rollout` of the step's rows."""
        if extras is None:
            raise ValueError("train.objective grpo needs each row's advantage: give the step's `Rollout` as its extras")
        part = extras.rows(mine)
        n_sequences, n_tokens = len(lengths), int(lengths.sum())
        self.begin_step(sequence_of, part.advantages, part.old_logps, part.ref_logps, n_sequences, n_tokens)

    def loss(self, logps: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The clipped surrogate (plus `beta` x KL) of `logps` [trained tokens], aggregated as `loss_type` over the
        whole step's sequences or tokens (so processes' losses add up); metrics: TRL's clip ratios, and `kl` where
        `beta`, means over this process's tokens."""
        owner = self.owner.to(logps.device)
        lengths = self.lengths.to(logps).clamp_min(1)
        old = logps.detach() if self.old is None else self.old.to(logps)
        log_ratio = logps - old
        if self.level == "sequence":
            per_sequence = torch.zeros(self.n_sequences, dtype=logps.dtype, device=logps.device)
            log_ratio = (per_sequence.index_add(0, owner, log_ratio) / lengths)[owner]
        ratio = torch.exp(log_ratio)
        clipped = torch.clamp(ratio, 1 - self.epsilon_low, 1 + self.epsilon_high)
        advantages = self.advantages.to(logps)[owner]
        per_token = -torch.min(ratio * advantages, clipped * advantages)
        # (TRL's GSPO clip ratios are shares of sequences: each sequence's tokens weigh 1 / its length in all)
        weights = 1 / lengths[owner] if self.level == "sequence" else torch.ones_like(ratio)
        metrics = _clip_metrics(ratio.detach(), advantages, self.epsilon_low, self.epsilon_high, weights)
        if self.beta:
            gap = self.ref.to(logps) - logps
            kl = torch.exp(gap) - gap - 1
            if self.use_bias_correction_kl:
                kl = kl * ratio
            per_token = per_token + self.beta * kl
            metrics["kl"] = kl.detach().mean()
        return self._aggregate(per_token, owner, lengths), metrics

    def _aggregate(self, per_token: Tensor, owner: Tensor, lengths: Tensor) -> Tensor:
        if self.loss_type == "grpo":
            sums = torch.zeros(self.n_sequences, dtype=per_token.dtype, device=per_token.device)
            return (sums.index_add(0, owner, per_token) / lengths).sum() / self.total_sequences
        if self.loss_type == "dr_grpo":
            return per_token.sum() / (self.total_sequences * self.max_completion_length)
        return per_token.sum() / max(self.total_tokens, 1)  # bnpo, dapo


def _clip_metrics(ratio: Tensor, advantages: Tensor, low: float, high: float, weights: Tensor) -> dict[str, Tensor]:
    """TRL's clip ratios: the share of tokens (by `weights`) whose ratio the clip holds (below with a negative
    advantage, above with a positive one)."""
    below = (ratio < 1 - low) & (advantages < 0)
    above = (ratio > 1 + high) & (advantages > 0)
    held = {"low": below, "high": above, "region": below | above}
    return {f"clip_ratio/{name}_mean": (where * weights).sum() / weights.sum() for name, where in held.items()}


def group_advantages(rewards: Tensor, num_generations: int, scale_rewards: str = "group") -> tuple[Tensor, dict]:
    """Each completion's advantage from the rewards of a step's groups (`num_generations` consecutive completions of
    one prompt), as TRL's GRPOTrainer: the reward less its group's mean, divided (scale_rewards "group") by the
    group's standard deviation + 1e-4, ("batch") by the whole batch's, or ("none") not (Dr. GRPO). Metrics: TRL's
    reward, reward_std and frac_reward_zero_std (groups whose rewards are all equal: zero advantage)."""
    if rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of num_generations {num_generations}")
    groups = rewards.view(-1, num_generations)
    mean = groups.mean(1).repeat_interleave(num_generations)
    group_std = groups.std(1) if num_generations > 1 else torch.zeros(len(groups), dtype=rewards.dtype)
    std = group_std.repeat_interleave(num_generations) if scale_rewards != "batch" else rewards.std().expand_as(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    metrics = {
        "reward": rewards.mean(),
        "reward_std": std.mean(),
        "frac_reward_zero_std": torch.isclose(std, torch.zeros_like(std)).to(rewards.dtype).mean(),
    }
    return advantages, metrics
