"""What the tests that train against transformers share: megatrain's trainer on a Hugging Face directory,
torch's AdamW with megatrain's weight-decay rule, random batches and transformers' label convention."""

import contextlib
import importlib
import inspect
import math

import torch
import transformers
from transformers.activations import ACT2FN

from megatrain import Trainer
from megatrain.config import AdapterSection, Config, EngineSection, ModelSection, PrecisionSection, TrainSection
from megatrain_data import DataSection
from megatrain_optim import Schedule, lr_at

# megatrain's rule: no weight decay on vectors
NO_DECAY = ("norm.weight", ".bias", "_bias", "sinks", "A_log", "mamba.D")


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
    precision="float32",
    adam_eps=TrainSection.eps,
    adapter=AdapterSection(),
    implementation="auto",
):
    train = TrainSection(
        eps=adam_eps,
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
        model=ModelSection(hf_dir=str(hf_dir), implementation=implementation, adapter=adapter),
        data=DataSection(seq_len=12),
        train=train,
        precision=PrecisionSection(precision),
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


def exact_reference(reference, model_config):
    """(reference, `make_trainer` options, context to step the reference in) for training steps against transformers:
    as they are in fp32 (dense models with AdamW's epsilon 1e-6); with linear attention both in float64, the
    reference's delta rule or Mamba-2 scan token by token (`recurrences_token_by_token`), AdamW's epsilon 1e-3.
    Measured on the tiny Qwen3.5 and Qwen3-Next models: transformers' own delta rule computes in fp32 whatever the
    model's dtype, and its chunked triangular solves leave fp32 gradient norms up to 2.6e-5 from float64
    (megatrain's the same; with softmax attention on every layer 3e-7); with experts that noise flipped routing
    near-ties in about one test of 150. AdamW's first update is lr * sign(gradient), so the reference's remaining
    fp32 steps (its norms, A_log) flipped near-zero gradient elements into lr-sized weight differences (gradient
    norms up to 1.2e-4 apart two steps on); an epsilon of 1e-3 makes that update continuous in the gradient. The
    delta-rule families' norms run in float64 too: near a zero key, the l2 norm's gradient scaled their fp32 noise
    into a gradient spike 1.4e-4 apart (tiny Qwen3.5, seed 1809767185; 5.7e-7 with the norms in float64). What is
    left: gradient norms up to 2.2e-6 apart over six steps (62 seeded runs of tiny Qwen3.5, Qwen3.5-MoE, Qwen3-Next
    and Granite 4.0-H; `grad_norm_tolerance` keeps 1e-4), losses within 1e-5 and weights within 1e-4 as every
    family. In fp32 the same flip happens where a gradient element is near 1e-9 (one k_proj
    weight of a tiny Granite 4.0 moved 2e-5 and the next step's gradient norm 1.05e-5, seed 1497917820); an epsilon
    of 1e-6 keeps such elements' first update far below lr and the norms within 6e-7 (48 seeded runs of four
    families)."""
    if not model_config.linear_attention_layers:
        # (experts keep the default: epsilon 1e-6 spreads fp32 noise over more elements' first updates, ~1e-6 each,
        # which flipped a routing near-tie of a tiny Llama 4 at its next step, seed 1280473694)
        return reference, {} if model_config.is_moe else {"adam_eps": 1e-6}, contextlib.nullcontext()
    reference = reference.double()
    if model_config.is_moe:
        reference.set_experts_implementation("eager")  # (transformers' grouped GEMMs take no float64)
    return reference, {"precision": "float64", "adam_eps": 1e-3}, recurrences_token_by_token()


def _mamba2_norms_per_group() -> None:
    """transformers' Granite 4.0-H with its Mamba-2 layers' gated output norm normalising each group of channels
    apart, as Mamba-2 defines it (mamba_ssm's RMSNormGated with group_size = inner / n_groups, and transformers'
    own since it fixed its norm): up to 5.17 (the GPU machines' at this writing) it normalised the whole width,
    which differs where a model has several groups (the tiny preset does; the published models have one). A
    no-op on a transformers whose norm takes its group size."""
    module = importlib.import_module(_SSD_MODULE)
    norm_class, layer_class = module.GraniteMoeHybridRMSNormGated, module.GraniteMoeHybridMambaLayer
    if "group_size" in inspect.signature(norm_class.__init__).parameters:
        return
    layer_init = layer_class.__init__

    def init_with_groups(self, *args, **kwargs):
        layer_init(self, *args, **kwargs)
        self.norm.group_size = self.intermediate_size // self.n_groups

    layer_class.__init__ = init_with_groups
    norm_class.forward = _group_gated_rms_norm


def _group_gated_rms_norm(self, hidden_states, gate=None):
    """Mamba-2's gated RMSNorm over groups of `self.group_size` channels, in fp32 as transformers computes it."""
    dtype = hidden_states.dtype
    gated = (
        hidden_states.float() * torch.nn.functional.silu(gate.float()) if gate is not None else hidden_states.float()
    )
    groups = gated.unflatten(-1, (-1, self.group_size))
    normed = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).flatten(-2)
    return self.weight * normed.to(dtype)


def reload_export(exported, reference, auto_class=transformers.AutoModelForCausalLM, **options):
    """megatrain's export loaded in transformers (by `auto_class`, with `options`) in the reference's dtype: float64
    where the steps ran in float64 (linear attention), so a logits check measures the export, not fp32's rounding
    through a recurrence (tiny Qwen3.5's logits reloaded in fp32 came 1.15e-5 from megatrain's float64 ones on one
    CI seed)."""
    reloaded = auto_class.from_pretrained(exported, dtype=next(reference.parameters()).dtype, **options).eval()
    if reloaded.dtype == torch.float64 and hasattr(reloaded, "set_experts_implementation"):
        reloaded.set_experts_implementation("eager")  # (transformers' grouped GEMMs take no float64)
    return reloaded


def grad_norm_tolerance(model_config) -> float:
    """Relative tolerance for gradient norms in steps against `exact_reference`: 1e-5, 1e-4 with linear attention."""
    return 1e-4 if model_config.linear_attention_layers else 1e-5


_DELTA_RULE_MODULES = [f"transformers.models.{m}.modeling_{m}" for m in ("qwen3_next", "qwen3_5", "qwen3_5_moe")]
_SSD_MODULE = "transformers.models.granitemoehybrid.modeling_granitemoehybrid"
_mamba2_norms_per_group()


@contextlib.contextmanager
def recurrences_token_by_token():
    """transformers' Qwen3-Next, Qwen3.5 and Granite 4.0-H models with their delta rule and Mamba-2 scan computed
    token by token in the inputs' dtype (transformers' own chunked forms compute in fp32 whatever the model's), and
    the delta-rule families' RMSNorms in it too: a float64 reference whose remaining fp32 steps (A_log, rotary,
    softmax; Granite's norms) are as small as other families' (~6e-8), so that a routing near-tie does not flip
    between it and megatrain. Independent forms: megatrain's chunked ones are not used."""
    patches = _token_by_token_patches()
    saved = [getattr(owner, name) for owner, name, _ in patches]
    for owner, name, replacement in patches:
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        for (owner, name, _), original in zip(patches, saved):
            setattr(owner, name, original)


def _token_by_token_patches() -> list[tuple]:
    """(module or class, attribute, replacement) for `recurrences_token_by_token`."""
    patches = []
    for module in map(importlib.import_module, _DELTA_RULE_MODULES):
        patches.append((module, "torch_chunk_gated_delta_rule", _delta_rule_token_by_token))
        for name, value in vars(module).items():
            if name.endswith("RMSNorm"):
                patches.append((value, "forward", _one_plus_norm_in_input_dtype))
            elif name.endswith("RMSNormGated"):
                patches.append((value, "forward", _gated_norm_in_input_dtype))
    patches.append((importlib.import_module(_SSD_MODULE), "mamba2_chunk_scan", _ssd_token_by_token))
    return patches


def _delta_rule_token_by_token(query, key, value, g, beta, initial_state=None, output_final_state=False, **kwargs):
    """transformers' `torch_chunk_gated_delta_rule`, token by token in the inputs' dtype."""
    repeat = value.shape[2] // key.shape[2]
    query, key = query.repeat_interleave(repeat, 2), key.repeat_interleave(repeat, 2)
    query = query * torch.rsqrt((query * query).sum(-1, keepdim=True) + 1e-6) / math.sqrt(query.shape[-1])
    key = key * torch.rsqrt((key * key).sum(-1, keepdim=True) + 1e-6)
    g, beta = g.to(value.dtype), beta.to(value.dtype)
    state = value.new_zeros(value.shape[0], value.shape[2], key.shape[-1], value.shape[-1])
    outputs = []
    for t in range(value.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        predicted = torch.einsum("bhkv,bhk->bhv", state, key[:, t])
        state = state + torch.einsum("bhk,bhv->bhkv", key[:, t], beta[:, t, :, None] * (value[:, t] - predicted))
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, query[:, t]))
    return torch.stack(outputs, dim=1), state if output_final_state else None


def _ssd_token_by_token(
    x, dt, a, b, c, chunk_size, D=None, dt_bias=None, initial_states=None, dt_softplus=False, **kwargs
):
    """transformers' `mamba2_chunk_scan` (Granite 4.0-H), token by token in the inputs' dtype."""
    dt = dt + dt_bias if dt_bias is not None else dt
    dt = torch.nn.functional.softplus(dt) if dt_softplus else dt
    dt, a = dt.clamp(*kwargs.get("dt_limit", (0.0, math.inf))).to(x.dtype), a.to(x.dtype)
    b, c = (t.to(x.dtype).repeat_interleave(x.shape[2] // t.shape[2], 2) for t in (b, c))
    state = x.new_zeros(x.shape[0], x.shape[2], x.shape[-1], b.shape[-1])  # [batch, heads, head_dim, state]
    if initial_states is not None:
        state = initial_states.to(x.dtype)
    outputs = []
    for t in range(x.shape[1]):
        state = state * (dt[:, t] * a).exp()[..., None, None]
        state = state + torch.einsum("bhp,bhn->bhpn", dt[:, t, :, None] * x[:, t], b[:, t])
        outputs.append(torch.einsum("bhpn,bhn->bhp", state, c[:, t]))
    out = torch.stack(outputs, dim=1)
    out = out if D is None else out + D[:, None].to(x.dtype) * x
    return (out, state) if kwargs.get("return_final_states") else out


def _one_plus_norm_in_input_dtype(self, x):
    """Qwen3.5's and Qwen3-Next's (1 + weight) RMSNorm in its input's dtype (transformers' computes in fp32)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.to(x.dtype))


def _gated_norm_in_input_dtype(self, hidden_states, gate):
    """Their linear attention's gated RMSNorm in its input's dtype (transformers' computes in fp32)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    normed = self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))
    return normed * ACT2FN[self.activation](gate.to(hidden_states.dtype))


def check_extra_tensors_are_left_out(reference, extra: dict, what: str, tmp_path, capsys):
    """`reference` (a transformers model) saved with the `extra` tensors added, which megatrain's model does not
    have (`ModelSpec.left_out`): it says it leaves them out as `what`, computes the reference's logits, and
    `megatrain convert` writes the checkpoint without them."""
    from safetensors.torch import load_file, save_file

    from megatrain.export import convert

    reference.save_pretrained(tmp_path / "hf")
    (weights,) = (tmp_path / "hf").glob("*.safetensors")
    tensors = {**load_file(str(weights)), **extra}
    save_file(tensors, str(weights), metadata={"format": "pt"})
    trainer, _ = make_trainer(tmp_path / "hf", tmp_path, 0.0, steps=1)
    assert f"leaving out {len(extra)} tensors of {what}" in capsys.readouterr().err
    ids = torch.randint(0, trainer.model_config.vocab_size, (2, 12))
    with torch.no_grad():
        assert rel_err(trainer.logits(ids), reference(ids).logits) < 1e-5
    trainer.close()
    written = load_file(str(convert(tmp_path / "hf", tmp_path / "converted") / "model.safetensors"))
    assert set(written) == set(tensors) - set(extra)


def rms_norm_in_input_dtype(self, hidden_states):
    """transformers' RMSNorm in its input's dtype (its own computes in fp32, which a float64 reference cannot)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


@contextlib.contextmanager
def float64_reference(model):
    """`model` (transformers') computing wholly in float64 within the block: its RMSNorms in their input's dtype,
    its attention through SDPA (the eager one takes its softmax in fp32)."""
    model.set_attn_implementation("sdpa")
    classes = {type(m) for m in model.modules() if type(m).__name__.endswith("RMSNorm")}
    saved = {c: c.forward for c in classes}
    try:
        for c in classes:
            c.forward = rms_norm_in_input_dtype
        yield
    finally:
        for c, forward in saved.items():
            c.forward = forward
