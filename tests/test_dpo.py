"""DPO steps against plain PyTorch + torch.optim.AdamW: each completion's summed log-probability from the model's
logits, the loss as the papers state it (written out here, apart from megatrain_templates.objectives), the
reference model a frozen copy of the initial weights. The model is transformers' in float32 and the tests' own
nn.Module in float64 (transformers computes its norms in fp32 whatever the dtype: 1e-9 from float64). Fresh
weights and pairs every run."""

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
import transformers
from reference_model import ReferenceLM, reference_adamw
from test_exactness import CASES, rel_err

from megatrain import Trainer
from megatrain.config import Config, ConfigError, DPOSection, ModelSection, PrecisionSection, TrainSection
from megatrain.step import StepBatch
from megatrain_data import Batch, DataSection, pack_pairs
from megatrain_optim import Schedule, lr_at
from megatrain_templates import SequenceObjective, Sequences
from megatrain_zoo import config_to_hf, preset

SEQ = 14


def random_pairs(n_pairs: int, vocab: int, generator: torch.Generator):
    """(input_ids, labels) of n_pairs pairs: rows 2i (chosen) and 2i + 1 (rejected) share a prompt of 3-6 tokens
    (untrained) and end in completions of their own, trained, padded to SEQ."""
    ids = torch.randint(0, vocab, (2 * n_pairs, SEQ), generator=generator)
    labels = torch.full_like(ids, -100)
    for pair in range(n_pairs):
        prompt = int(torch.randint(3, 7, (), generator=generator))
        ids[2 * pair + 1, :prompt] = ids[2 * pair, :prompt]
        for row in (2 * pair, 2 * pair + 1):
            end = int(torch.randint(prompt + 2, SEQ + 1, (), generator=generator))
            labels[row, prompt - 1 : end - 1] = ids[row, prompt:end]
    return ids, labels


def completion_logps(model, ids, labels) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of each row's trained tokens, their count) from the model's logits."""
    logits = model.logits(ids) if isinstance(model, ReferenceLM) else model(input_ids=ids).logits
    logps = logits.log_softmax(-1).gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    trained = labels != -100
    return (logps * trained).sum(-1), trained.sum(-1)


def paper_loss(sums, lengths, ref_sums, dpo: DPOSection):
    """The mean over pairs of each paper's loss (rows 2i chosen, 2i + 1 rejected)."""
    beta, eps = dpo.beta, dpo.label_smoothing
    mean, ref_mean = sums / lengths, ref_sums / lengths
    c, r = sums[0::2], sums[1::2]
    if dpo.loss_type in ("sigmoid", "robust", "hinge"):
        x = (c - ref_sums[0::2]) - (r - ref_sums[1::2])
        if dpo.loss_type == "hinge":
            return torch.clamp(1 - beta * x, min=0).mean()
        sign = -1 if dpo.loss_type == "sigmoid" else 1
        loss = -(1 - eps) * F.logsigmoid(beta * x) + sign * eps * F.logsigmoid(-beta * x)
        return (loss / (1 if dpo.loss_type == "sigmoid" else 1 - 2 * eps)).mean()
    if dpo.loss_type == "ipo":
        x = (mean[0::2] - ref_mean[0::2]) - (mean[1::2] - ref_mean[1::2])
        return ((x - 1 / (2 * beta)) ** 2).mean()
    if dpo.loss_type == "simpo":
        return -F.logsigmoid(beta * (mean[0::2] - mean[1::2]) - dpo.simpo_gamma).mean()
    chosen, rejected = mean[0::2], mean[1::2]  # orpo
    odds = torch.log(chosen.exp() / (1 - chosen.exp())) - torch.log(rejected.exp() / (1 - rejected.exp()))
    return -c.sum() / lengths[0::2].sum() - beta * F.logsigmoid(odds).mean()


@pytest.mark.parametrize("dtype", list(CASES))
@pytest.mark.parametrize(
    "dpo",
    [
        DPOSection(beta=0.5),
        DPOSection(beta=0.3, label_smoothing=0.2),  # cDPO
        DPOSection(beta=0.3, loss_type="robust", label_smoothing=0.2),
        DPOSection(beta=0.5, loss_type="hinge"),
        DPOSection(beta=0.5, loss_type="ipo"),
        DPOSection(beta=2.0, loss_type="simpo", simpo_gamma=0.5),
        DPOSection(beta=0.5, loss_type="orpo"),
    ],
    ids=["sigmoid", "cdpo", "robust", "hinge", "ipo", "simpo", "orpo"],
)
def test_dpo_steps_equal_transformers(dtype, dpo, tmp_path):
    check_dpo_steps(dtype, dpo, "tiny-llama", tmp_path, micro_batch_size=1)


@pytest.mark.parametrize("micro_batch_size", [1, 3])  # a pair's two rows in one micro-batch, pairs across two
def test_dpo_micro_batches_give_the_step_of_one_batch(micro_batch_size, tmp_path):
    check_dpo_steps("float64", DPOSection(beta=0.5), "tiny-qwen2", tmp_path, micro_batch_size=micro_batch_size)


@pytest.mark.parametrize("micro_batch_size", [1, 2])
@pytest.mark.parametrize("dpo", [DPOSection(beta=0.5), DPOSection(beta=0.5, loss_type="ipo")], ids=["sigmoid", "ipo"])
def test_packed_pairs_give_the_steps_of_pairs_a_row_each(dpo, micro_batch_size, tmp_path):
    """data.pack: pairs share rows of twice the width (each sequence attending only to itself, positions
    restarting), and the steps, the reference pass and the weights equal the plain model's on the unpacked rows."""
    check_dpo_steps("float64", dpo, "tiny-llama", tmp_path, micro_batch_size, n_pairs=6, pack=True)


@pytest.mark.gpu
def test_gpu_packed_pairs_give_the_steps_of_pairs_a_row_each(tmp_path):
    check_dpo_steps("float64", DPOSection(beta=0.5), "tiny-llama", tmp_path, 2, n_pairs=6, device="cuda", pack=True)


def packed(ids: torch.Tensor, labels: torch.Tensor) -> Batch:
    """The pairs packed into rows of 2 * SEQ: each row's real tokens end at its last target."""
    last = torch.where(labels != -100, torch.arange(SEQ), -1).amax(-1)
    valid = torch.arange(2 * SEQ) < (last + 2).unsqueeze(1)
    wide = torch.zeros(len(ids), 2 * SEQ, dtype=ids.dtype)
    wide[:, :SEQ] = ids
    wide_labels = torch.full_like(wide, -100)
    wide_labels[:, :SEQ] = labels
    batch = pack_pairs(Batch(wide, wide_labels, None, valid))
    assert len(batch.input_ids) < len(ids)  # (some pairs share a row)
    return batch


def plain_model(preset_name: str, dtype: str, weights: dict):
    """transformers' model of the preset (float32), or the tests' own (float64), with `weights`."""
    if dtype == "float64":
        model = ReferenceLM(preset(preset_name)).double()
        model.load_named({k: v.clone() for k, v in weights.items()})
        return model
    hf_config = transformers.AutoConfig.for_model(**config_to_hf(preset(preset_name)))
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, attn_implementation="eager")
    model.load_state_dict({k: v.clone() for k, v in weights.items()}, strict=False)
    if preset(preset_name).tie_embeddings:
        model.tie_weights()
    return model


@pytest.mark.gpu
@pytest.mark.parametrize("loss_type", ["sigmoid", "orpo"])
def test_gpu_dpo_steps_equal_plain_pytorch(loss_type, tmp_path):
    """The CUDA engine (streams, the head's chunks, resident first layers) in float64 against the plain model."""
    check_dpo_steps("float64", DPOSection(beta=0.5, loss_type=loss_type), "tiny-qwen2", tmp_path, 1, device="cuda")


def dpo_trainer(dtype, dpo, preset_name, tmp_path, n_pairs, micro_batch_size, steps, seed, device):
    """(megatrain's DPO Trainer of `preset_name`, its TrainSection)."""
    train = TrainSection(
        steps=steps, batch_size=n_pairs, micro_batch_size=micro_batch_size, lr=CASES[dtype][0], eps=1e-6,
        weight_decay=0.1, grad_clip=0.0, warmup_steps=1, seed=seed, objective="dpo", dpo=dpo,
    )  # fmt: skip
    config = Config(
        model=ModelSection(preset=preset_name),
        data=DataSection(seq_len=SEQ),
        train=train,
        precision=PrecisionSection(dtype),
        device=device,
        output_dir=str(tmp_path),
    )
    return Trainer(config), train


def check_dpo_steps(
    dtype, dpo: DPOSection, preset_name, tmp_path, micro_batch_size, steps=3, n_pairs=3, device="cpu", pack=False
):
    tolerance = CASES[dtype][1]
    seed = int(torch.randint(0, 2**31 - 1, ()))
    trainer, train = dpo_trainer(dtype, dpo, preset_name, tmp_path, n_pairs, micro_batch_size, steps, seed, device)
    model = plain_model(preset_name, dtype, trainer.named_weights()).to(device)  # (on the engine's device: its GEMMs)
    frozen = copy.deepcopy(model).eval()
    optimizer = reference_adamw(model, train)
    schedule = Schedule(train.lr, train.steps, train.warmup_steps, train.schedule, train.min_lr_ratio)
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        ids, labels = random_pairs(n_pairs, trainer.model_config.vocab_size, generator)
        rows = packed(ids, labels) if pack else Batch(ids, labels)
        given = (rows.input_ids, rows.labels, rows.position_ids, rows.valid)
        ours_reference = trainer.sequence_logps(StepBatch(*given, rows.sequences)) if step == 0 else None
        with torch.no_grad():
            ref_sums, lengths = (t.cpu() for t in completion_logps(frozen, ids.to(device), labels.to(device)))
        if ours_reference is not None:  # the engine's forward-only pass equals the model's at the initial weights
            assert rel_err(ours_reference.logps, ref_sums) < tolerance
        reference = Sequences(ref_sums.double(), lengths.double()) if dpo.needs_reference else None
        metrics = trainer.train_step(StepBatch(*given, extras=reference, sequences=rows.sequences))
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, schedule)
        optimizer.zero_grad()
        sums, _ = completion_logps(model, ids.to(device), labels.to(device))
        loss = paper_loss(sums, lengths.to(sums), ref_sums.to(sums), dpo)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        optimizer.step()
        assert metrics.loss == pytest.approx(loss.item(), rel=tolerance, abs=tolerance)
        assert metrics.grad_norm == pytest.approx(norm.item(), rel=10 * tolerance)
        assert {"rewards/chosen", "rewards/accuracies", "logps/rejected"} <= set(metrics.as_dict())
    ours = trainer.named_weights()
    for name, param in model.named_parameters():
        assert rel_err(ours[name], param.detach().cpu()) < 10 * tolerance, name
    trainer.close()


class PerSequenceMean(SequenceObjective):
    """An objective of a few lines (the guide's example): the cross-entropy averaged over each sequence's tokens,
    then over the sequences, so that each example counts once, long or short."""

    def loss(self, policy: Sequences):
        per_sequence = -policy.mean_logps
        return per_sequence.mean(), {"loss/per_sequence_max": per_sequence.max().detach()}


def test_an_objective_of_your_own_trains_as_its_formula(tmp_path):
    seed = int(torch.randint(0, 2**31 - 1, ()))
    train = TrainSection(
        steps=3, batch_size=4, micro_batch_size=2, lr=1e-2, eps=1e-6, grad_clip=0.0, warmup_steps=1, seed=seed,
        objective="test_dpo:PerSequenceMean",
    )  # fmt: skip
    config = Config(
        model=ModelSection(preset="tiny-llama"),
        data=DataSection(seq_len=SEQ),
        train=train,
        precision=PrecisionSection("float64"),
        device="cpu",
        output_dir=str(tmp_path),
    )
    trainer = Trainer(config)
    model = plain_model("tiny-llama", "float64", trainer.named_weights())
    no_decay = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    decay = [p for p in model.parameters() if all(p is not q for q in no_decay)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-2,
        betas=train.betas,
        eps=1e-6,
    )
    schedule = Schedule(train.lr, train.steps, train.warmup_steps, train.schedule, train.min_lr_ratio)
    generator = torch.Generator().manual_seed(seed)
    for step in range(train.steps):
        ids, labels = random_pairs(2, trainer.model_config.vocab_size, generator)  # four sequences of any lengths
        metrics = trainer.train_step(StepBatch(ids, labels))
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, schedule)
        optimizer.zero_grad()
        sums, lengths = completion_logps(model, ids, labels)
        loss = (-sums / lengths).mean()
        loss.backward()
        optimizer.step()
        assert metrics.loss == pytest.approx(loss.item(), rel=1e-10)
        assert metrics.as_dict()["loss/per_sequence_max"] == pytest.approx((-sums / lengths).max().item())
    ours = trainer.named_weights()
    assert all(rel_err(ours[name], param.detach()) < 1e-9 for name, param in model.named_parameters())
    trainer.close()
    with pytest.raises(ConfigError, match="train.objective 'test_dpo:Nothing' cannot be made"):
        Trainer(replace(config, train=replace(train, objective="test_dpo:Nothing")))


@pytest.mark.parametrize("name", ["tiny-mixtral", "tiny-qwen3-moe"])
def test_dpo_on_a_mixture_of_experts_adds_its_load_balancing_loss(name, tmp_path):
    """A mixture of experts trained with DPO: the step's loss is DPO's plus the routers' load-balancing loss over
    every sequence of the step, as transformers' model (output_router_logits) gives it; steps equal transformers.
    Both in float64 (the reference's norms and attention too, `float64_reference`): in fp32, AdamW's first update,
    lr * sign(gradient), turned rounding noise in near-zero gradients into lr-sized weight differences, which flipped
    a routing near-tie at the next step (tiny Qwen3-MoE: a loss 1.5e-5 off, about one run in fifty)."""
    from hf_steps import float64_reference
    from test_moe import hf_model

    seed = int(torch.randint(0, 2**31 - 1, ()))
    model = hf_model(name, True, seed)
    model.save_pretrained(tmp_path / "hf")
    model = model.double()
    model.set_experts_implementation("eager")  # (transformers' grouped GEMMs take no float64)
    frozen = copy.deepcopy(model).eval()
    dpo = DPOSection(beta=0.5)
    train = TrainSection(
        steps=3, batch_size=3, micro_batch_size=1, lr=1e-4, grad_clip=0.0, warmup_steps=1, seed=seed,
        objective="dpo", dpo=dpo,
    )  # fmt: skip
    config = Config(
        model=ModelSection(hf_dir=str(tmp_path / "hf")),
        data=DataSection(seq_len=SEQ),
        train=train,
        precision=PrecisionSection("float64"),
        device="cpu",
        output_dir=str(tmp_path / "run"),
    )
    trainer = Trainer(config)
    with float64_reference(model), float64_reference(frozen):
        check_moe_dpo_steps(trainer, train, dpo, model, frozen, seed)
    trainer.close()


def check_moe_dpo_steps(trainer, train, dpo, model, frozen, seed) -> None:
    """`trainer`'s DPO steps of a mixture of experts equal transformers' `model` (its load-balancing loss added),
    `frozen` the reference."""
    no_decay = [p for n, p in model.named_parameters() if n.endswith("norm.weight") or n.endswith(".bias")]
    decay = [p for p in model.parameters() if all(p is not q for q in no_decay)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=train.lr,
        betas=train.betas,
        eps=train.eps,
    )
    schedule = Schedule(train.lr, train.steps, train.warmup_steps, train.schedule, train.min_lr_ratio)
    generator = torch.Generator().manual_seed(seed)
    for step in range(train.steps):
        ids, labels = random_pairs(train.batch_size, trainer.model_config.vocab_size, generator)
        with torch.no_grad():
            ref_sums, lengths = completion_logps(frozen, ids, labels)
        metrics = trainer.train_step(StepBatch(ids, labels, extras=Sequences(ref_sums.double(), lengths.double())))
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, schedule)
        optimizer.zero_grad()
        out = model(input_ids=ids)
        logps = out.logits.log_softmax(-1).gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        sums = (logps * (labels != -100)).sum(-1)
        loss = paper_loss(sums, lengths.to(sums), ref_sums, dpo) + model.config.router_aux_loss_coef * out.aux_loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        optimizer.step()
        assert metrics.loss == pytest.approx(loss.item(), rel=1e-5)
        assert metrics.router_aux_loss == pytest.approx(out.aux_loss.item(), rel=1e-5)
        assert metrics.grad_norm == pytest.approx(norm.item(), rel=1e-4)
