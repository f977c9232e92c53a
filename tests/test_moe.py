"""Mixture-of-experts models train exactly like transformers: several optimizer steps of megatrain
(fp32, micro-batches, clipping, weight decay) equal transformers' own model + torch.optim.AdamW on
the same batches, with and without the load-balancing loss; exported directories load in
transformers with equal logits; transformers' fused 3-D expert layout imports too."""

import json

import numpy as np
import pytest
import torch
import transformers  # installed by the integration nox session
from hf_steps import (
    check_extra_tensors_are_left_out,
    exact_reference,
    grad_norm_tolerance,
    hf_adamw,
    hf_labels,
    make_trainer,
    random_batch,
    reference_step,
    rel_err,
    reload_export,
)
from safetensors.torch import save_file

from megatrain import Trainer
from megatrain.config import Config, ConfigError, EngineSection, ModelSection, PrecisionSection, TrainSection
from megatrain.step import StepBatch
from megatrain_data import DataSection
from megatrain_store import StoreError
from megatrain_zoo import config_to_hf, preset

MOE_PRESETS = [
    "tiny-mixtral",
    "tiny-qwen2-moe",
    "tiny-qwen3-moe",
    "tiny-olmoe",
    "tiny-gpt-oss",
    "tiny-deepseek-v2",
    "tiny-deepseek-v3",
    "tiny-glm4-moe",
    "tiny-minimax-m2",
    "tiny-dots1",
    "tiny-ernie4_5-moe",
    "tiny-qwen3.5-moe",
    "tiny-qwen3-next",
]
# routers that choose with a correction bias
BIASED_PRESETS = ["tiny-deepseek-v3", "tiny-glm4-moe", "tiny-minimax-m2", "tiny-dots1", "tiny-ernie4_5-moe"]
# transformers trains these with no load-balancing loss
NO_AUX_LOSS = ("tiny-deepseek-v2", "tiny-deepseek-v3", "tiny-glm4-moe", "tiny-dots1")
# transformers' load-balancing loss for these counts other experts than the ones chosen: refused with the fix
# (`test_load_balancing_loss_over_other_experts_is_refused`), so their steps run without it
AUX_LOSS_REFUSED = ("tiny-minimax-m2", "tiny-ernie4_5-moe")


def hf_model(name, aux: bool, seed: int, **overrides):
    """A transformers model of preset `name` with fresh random weights (norms and biases too)."""
    hf_config = transformers.AutoConfig.for_model(
        **{**config_to_hf(preset(name)), "output_router_logits": aux, "router_aux_loss_coef": 0.05, **overrides}
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):  # scales around one (a (1 + weight) norm's weight around zero)
                one_plus = preset(name).norm_scale == "one_plus_fp32" and "linear_attn.norm" not in param_name
                param.copy_((0.0 if one_plus else 1.0) + 0.2 * torch.randn_like(param))
            elif param_name.endswith(".bias"):
                param.copy_(0.05 * torch.randn_like(param))
            else:  # a router as large as the rest makes routing decisions that matter
                param.normal_(0.0, 0.1)
        for buffer_name, buffer in model.named_buffers():
            # as large as the scores' differences, so that it changes choices (a published model's offset of
            # ~7 would only coarsen fp32's grid, and its near-ties flip with the noise of the two computations)
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))
    return model.train()


@pytest.mark.parametrize(
    "name, aux",
    [(name, aux) for name in MOE_PRESETS for aux in (True, False) if not (aux and name in AUX_LOSS_REFUSED)],
)
def test_steps_match_transformers(name, aux, tmp_path):
    """With the load-balancing loss the last layer keeps its forward's matmul products (the backward's
    recompute reads them for its GEMMs); without it every layer recomputes."""
    check_steps_match_transformers(name, aux, tmp_path, "cpu", EngineSection(kept_layers=1 if aux else 0))


@pytest.mark.gpu
@pytest.mark.parametrize("name", MOE_PRESETS)
def test_gpu_steps_match_transformers(name, tmp_path):
    """The CUDA engine (streams, pinned memory) in fp32, TF32 off, against transformers on the CPU; correction
    biases balanced by load (on the GPU where the plan updates the first layers there) beside the
    sequence-wise balance loss and the router z-loss."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    bias_rate, seq_coef, z_coef = (0.01, 0.05, 0.01) if name in BIASED_PRESETS else (0.0, 0.0, 0.0)
    aux = name not in AUX_LOSS_REFUSED
    check_steps_match_transformers(name, aux, tmp_path, "cuda", bias_rate=bias_rate, seq_coef=seq_coef, z_coef=z_coef)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-qwen2-moe", "tiny-gpt-oss"])
def test_gpu_experts_in_parts_with_offloaded_checkpoints_match_transformers(name, tmp_path):
    """The CUDA engine with each layer's experts in parts and every checkpoint in pinned host memory:
    the parts of a layer keep one `a`, copied out once and brought back once, as exact as ever."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    engine = EngineSection(experts_per_stage=3, offload_checkpoints=True)
    check_steps_match_transformers(name, True, tmp_path, "cuda", engine)


def clamp_that_bites(name) -> dict:
    """gpt-oss' SwiGLU clamp at 1 instead of 7, so random weights hit it, where transformers reads the
    limit from the config (before 5.18 it fixed 7.0, which the published models use)."""
    if name != "tiny-gpt-oss":
        return {}
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    honoured = GptOssExperts(
        transformers.AutoConfig.for_model(**{**config_to_hf(preset(name)), "swiglu_limit": 1.0})
    ).limit
    return {"swiglu_limit": 1.0} if honoured == 1.0 else {}


@pytest.mark.parametrize("name", MOE_PRESETS)
def test_experts_streamed_in_parts_match_transformers(name, tmp_path):
    """A layer's experts in parts of 3 (uneven: 4, 6 and 8 experts make 2, 2 and 3 parts), a stage
    and a group each, the pair [residual, MLP sum] passed between them: the same training steps."""
    check_steps_match_transformers(
        name, name not in AUX_LOSS_REFUSED, tmp_path, "cpu", EngineSection(experts_per_stage=3)
    )


@pytest.mark.parametrize("name", AUX_LOSS_REFUSED)
def test_load_balancing_loss_over_other_experts_is_refused(name, tmp_path):
    """transformers adds MiniMax-M2's and ERNIE 4.5's loss over each token's unbiased top-k (softmax of the
    logits), not the experts its biased scores chose: a config asking for it is refused before anything is
    allocated."""
    from megatrain_zoo import ZooError

    hf_model(name, True, 8).save_pretrained(tmp_path / "hf")
    with pytest.raises(ZooError, match="output_router_logits=true"):
        make_trainer(tmp_path / "hf", tmp_path, 0.0, steps=1)


@pytest.mark.parametrize("experts_per_stage", ["auto", 3])
@pytest.mark.parametrize("name", BIASED_PRESETS)
def test_correction_biases_balanced_by_load_match_the_reference_rule(name, experts_per_stage, tmp_path):
    """`train.router_bias_update_rate`: each layer's correction bias moves by the rate against the sign of its
    experts' excess load over the step's micro-batches, exactly as DeepSeek-V3's rule applied to transformers'
    model (its loads read from the indices its experts are given), whole layers and experts in parts, clipped
    (the loads are no gradients: the norm leaves them out) and eager; the other weights as before."""
    engine = EngineSection(experts_per_stage=experts_per_stage)
    check_steps_match_transformers(name, name not in AUX_LOSS_REFUSED, tmp_path, "cpu", engine, bias_rate=0.01)


@pytest.mark.parametrize(
    "name, experts_per_stage",
    [("tiny-deepseek-v3", "auto"), ("tiny-deepseek-v3", 3), ("tiny-qwen3-moe", "auto"), ("tiny-ernie4_5-moe", 3)],
)
def test_sequence_wise_balance_loss_matches_deepseeks(name, experts_per_stage, tmp_path):
    """`train.router_seq_aux_loss_coef`: DeepSeek-V3's sequence-wise balance loss (with its biases moving by
    load where the router has them; with transformers' own load-balancing loss for Qwen3-MoE), each layer's
    statistics per sequence of each micro-batch: the same loss and steps as transformers' model with the
    loss added by DeepSeek's formula, whole layers and experts in parts, clipped and eager."""
    engine = EngineSection(experts_per_stage=experts_per_stage)
    bias_rate = 0.01 if name in BIASED_PRESETS else 0.0
    aux = name not in AUX_LOSS_REFUSED and name not in NO_AUX_LOSS
    check_steps_match_transformers(name, aux, tmp_path, "cpu", engine, bias_rate=bias_rate, seq_coef=0.05)


@pytest.mark.parametrize(
    "name, experts_per_stage", [("tiny-olmoe", "auto"), ("tiny-deepseek-v3", 3), ("tiny-ernie4_5-moe", "auto")]
)
def test_router_z_loss_matches_st_moes(name, experts_per_stage, tmp_path):
    """`train.router_z_loss_coef`: ST-MoE's router z-loss (OLMoE's recipe with its load-balancing loss;
    DeepSeek-V3's logits in parts): the same loss and steps as transformers' model with the z-loss added."""
    engine = EngineSection(experts_per_stage=experts_per_stage)
    aux = name not in AUX_LOSS_REFUSED and name not in NO_AUX_LOSS
    check_steps_match_transformers(name, aux, tmp_path, "cpu", engine, z_coef=0.05)


@pytest.mark.parametrize("name, bias_rate, seq_coef", [("tiny-qwen2-moe", 0.0, 0.0), ("tiny-deepseek-v3", 0.01, 0.05)])
def test_steps_in_sweeps_match_transformers(name, bias_rate, seq_coef, tmp_path):
    """A step's micro-batches in three sweeps: the expert layers' gradients summed over them, the correction biases
    moved by the whole step's loads, DeepSeek's sequence-wise loss (each sequence's own) as in one sweep."""
    engine = EngineSection(sweeps=3)
    check_steps_match_transformers(name, False, tmp_path, "cpu", engine, bias_rate=bias_rate, seq_coef=seq_coef)


@pytest.mark.parametrize("aux, z_coef", [(True, 0.0), (False, 0.05)])
def test_sweeps_beside_a_loss_of_the_whole_steps_routing_are_refused(aux, z_coef, tmp_path):
    """The load-balancing loss and the z-loss divide by the whole step's loads and tokens, which a step in sweeps
    lacks at its first backward: refused with the fix, before anything is allocated."""
    hf_model("tiny-qwen3-moe", aux, 1).save_pretrained(tmp_path / "hf")
    with pytest.raises(ConfigError, match="engine.sweeps 2: .* needs the whole step's routing before any backward"):
        make_trainer(tmp_path / "hf", tmp_path, 0.0, steps=1, engine=EngineSection(sweeps=2), router_z_loss_coef=z_coef)


def test_templates_and_store_name_the_load_balanced_rule_alike():
    """The templates mark the bias pair's specs; the store, which they do not import, acts on the mark."""
    import megatrain_store
    import megatrain_templates.layout

    assert megatrain_templates.layout.LOAD_BIAS == megatrain_store.LOAD_BIAS
    assert megatrain_templates.layout.ADAMW == megatrain_store.ADAMW


def test_a_bias_update_rate_needs_a_router_with_a_correction_bias(tmp_path):
    hf_model("tiny-qwen3-moe", False, 5).save_pretrained(tmp_path / "hf")
    with pytest.raises(ConfigError, match="router_aux_loss_coef"):
        make_trainer(tmp_path / "hf", tmp_path, 0.0, steps=1, router_bias_update_rate=1e-3)


def test_dots1_sliding_window_layers_match_transformers(tmp_path):
    """dots.llm1's windows from `max_window_layers` on (a window of 4 in 12-token rows: it bites), read
    from the `layer_types` transformers writes; the same steps, and exported back the same way."""
    check_steps_match_transformers("tiny-dots1", False, tmp_path, "cpu", sliding_window=4, max_window_layers=1)


def test_deepseek_v3_rotary_embedding_on_halves_matches_transformers(tmp_path):
    """`rope_interleave: false`: latent attention's rotary part on Llama's halves instead of pairs."""
    check_steps_match_transformers("tiny-deepseek-v3", False, tmp_path, "cpu", rope_interleave=False)


def test_a_dense_layer_and_a_moe_layer_keep_their_products_alike(tmp_path):
    """Qwen2-MoE with its last layer dense (mlp_only_layers): asked to keep two layers, the dense one and the
    MoE one before it keep their forward's matmul products; the same steps as transformers."""
    engine = EngineSection(kept_layers=2)
    check_steps_match_transformers("tiny-qwen2-moe", True, tmp_path, "cpu", engine, mlp_only_layers=[2])


class ReferenceLoads:
    """Each MoE layer's expert loads of a step in a transformers model (the indices its experts module is
    given), and DeepSeek-V3's balancing on it: the aux-loss-free rule as Megatron's `get_updated_expert_bias`
    (bias += rate * sign(mean load - load) after the step, in the bias's fp32), and the sequence-wise loss as
    DeepSeek's MoEGate `seq_aux` (per sequence: sum_e f_e P_e, f_e = n_experts * picks / (top_k * tokens),
    P_e the mean of the normalised scores or the probabilities; the mean over sequences, summed over layers),
    and ST-MoE's router z-loss (the mean over tokens of logsumexp(logits)^2, summed over layers)."""

    def __init__(self, model, n_experts: int, rate: float, sigmoid: bool = False):
        self.rate, self.sigmoid, self.loads, self.biases = rate, sigmoid, [], []
        self.sequence_terms, self.z_terms, self._router_input = [], [], {}
        for module in model.modules():
            if not isinstance(getattr(module, "experts", None), torch.nn.Module):
                continue
            loads = torch.zeros(n_experts)
            if isinstance(getattr(module, "gate", None), torch.nn.Module):
                module.gate.register_forward_pre_hook(self._keep_router_input(module))
            module.experts.register_forward_pre_hook(self._count(module, loads), with_kwargs=True)
            self.loads.append(loads)
            tensors = [*module.named_buffers(), *module.named_parameters()]  # (ERNIE's is a parameter)
            self.biases.append(next((t for name, t in tensors if name.endswith("e_score_correction_bias")), None))

    def _keep_router_input(self, module):
        def hook(gate, args):
            self._router_input[module] = args[0]

        return hook

    def _count(self, moe, loads):
        def hook(module, args, kwargs):
            top_index = args[1] if len(args) > 1 else next(v for k, v in kwargs.items() if "ind" in k)
            loads.add_(torch.bincount(top_index.reshape(-1), minlength=loads.numel()).float())
            if moe in self._router_input:
                h = self._router_input.pop(moe)
                logits = torch.nn.functional.linear(h.reshape(-1, h.shape[-1]).float(), moe.gate.weight.float())
                self.sequence_terms.append(self._sequence_term(logits, top_index))
                self.z_terms.append(logits.logsumexp(-1).square().mean())

        return hook

    def _sequence_term(self, logits, top_index):
        scores = logits.sigmoid() if self.sigmoid else logits.softmax(-1)
        probs = scores / scores.sum(-1, keepdim=True) if self.sigmoid else scores
        n_experts, k = probs.shape[-1], top_index.shape[-1]
        batch = self.batch
        picks = torch.zeros(batch, n_experts).scatter_add_(
            1, top_index.reshape(batch, -1), torch.ones(batch, top_index.numel() // batch)
        )
        tokens = top_index.shape[0] // batch
        shares = picks * n_experts / (k * tokens)
        return (shares * probs.view(batch, tokens, n_experts).mean(1)).sum(1).mean()

    def sequence_loss(self):
        return sum(self.sequence_terms)

    def z_loss(self):
        return sum(self.z_terms)

    def max_violation(self) -> float:
        loads = torch.stack(self.loads)
        return (loads.amax(1) / loads.mean(1) - 1).max().item()

    def step(self) -> None:
        with torch.no_grad():
            for loads, bias in zip(self.loads, self.biases):
                if bias is not None:
                    bias.add_(torch.sign(loads.sum() / loads.numel() - loads) * self.rate)
                loads.zero_()
        self.sequence_terms, self.z_terms = [], []


def check_steps_match_transformers(
    name, aux, tmp_path, device, engine=EngineSection(), bias_rate=0.0, seq_coef=0.0, z_coef=0.0, **overrides
):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    reference = hf_model(name, aux, seed, **{**clamp_that_bites(name), **overrides})
    reference, options, stepping = exact_reference(reference, preset(name))
    reference.save_pretrained(tmp_path / "hf")
    grad_clip = 0.5 if aux else 0.0  # both update policies: clipped (held gradients) and eager
    with stepping:
        check_steps(
            name, aux, tmp_path, device, engine, bias_rate, seq_coef, z_coef, reference, grad_clip, seed, options
        )


def check_steps(name, aux, tmp_path, device, engine, bias_rate, seq_coef, z_coef, reference, grad_clip, seed, options):
    trainer, train = make_trainer(
        tmp_path / "hf",
        tmp_path,
        grad_clip,
        steps=4,
        device=device,
        engine=engine,
        router_bias_update_rate=bias_rate,
        router_seq_aux_loss_coef=seq_coef,
        router_z_loss_coef=z_coef,
        **options,
    )
    assert bool(trainer.spec.expert_parts) == (engine.experts_per_stage != "auto")
    optimizer = hf_adamw(reference, train)
    sigmoid = trainer.model_config.router_scoring == "sigmoid"
    loads = ReferenceLoads(reference, trainer.model_config.n_experts, bias_rate, sigmoid)
    loads.batch = train.batch_size
    biases = [bias for bias in loads.biases if bias is not None]
    assert len(loads.loads) == sum(map(trainer.model_config.layer_is_moe, range(trainer.model_config.n_layers)))
    assert bool(biases) == trainer.model_config.router_bias
    initial_biases = [bias.clone() for bias in biases]
    generator = torch.Generator().manual_seed(seed)

    def router_losses():
        return sum(coef * loss() for coef, loss in ((seq_coef, loads.sequence_loss), (z_coef, loads.z_loss)) if coef)

    for step in range(train.steps):
        ids, labels = random_batch(train.batch_size, 12, trainer.model_config.vocab_size, generator)
        metrics = trainer.train_step(StepBatch(ids, labels))
        extra = router_losses if seq_coef or z_coef else None
        out, loss, norm = reference_step(
            reference, optimizer, train, step, grad_clip, extra, input_ids=ids, labels=labels
        )
        assert metrics.router_max_violation == pytest.approx(loads.max_violation())
        if seq_coef:
            assert metrics.router_seq_aux_loss == pytest.approx(loads.sequence_loss().item(), rel=1e-5)
        if z_coef:
            assert metrics.router_z_loss == pytest.approx(loads.z_loss().item(), rel=1e-5)
        loads.step()
        assert metrics.loss == pytest.approx(loss.item(), rel=1e-5)
        assert metrics.grad_norm == pytest.approx(norm.item(), rel=grad_norm_tolerance(trainer.model_config))
        if aux and name in NO_AUX_LOSS:
            assert getattr(out, "aux_loss", None) is None
        elif aux:
            assert metrics.router_aux_loss == pytest.approx(out.aux_loss.item(), rel=1e-5)
    check_placement_and_export(trainer, engine, device, reference, tmp_path)
    moved = [not torch.equal(bias, initial) for bias, initial in zip(biases, initial_biases)]
    assert any(moved) if bias_rate else not any(moved)


def check_placement_and_export(trainer, engine, device, reference, tmp_path):
    """After `check_steps`' steps: the sweeps and kept layers as set (auto: none on the CPU, some on a GPU), and
    the export loads in transformers with the reference's weights, its correction biases bit for bit, and
    megatrain's logits."""
    model = trainer.model_config
    assert trainer.pipeline.executed.sweeps == (1 if engine.sweeps == "auto" else engine.sweeps)
    kept = len(trainer.pipeline.executed.keeping)
    if engine.kept_layers != "auto":
        assert kept == min(engine.kept_layers, model.n_layers)
    elif device == "cpu":  # auto keeps none on the CPU
        assert kept == 0
    elif not trainer.spec.expert_parts:  # a GPU holds a tiny model's products (experts in parts keep none)
        assert kept > 0
    exported = trainer.export(tmp_path / "out")
    ids = torch.randint(0, model.vocab_size, (2, 12))
    our_logits = trainer.logits(ids)
    trainer.close()
    reloaded = reload_export(exported, reference)
    ours = dict(reloaded.named_parameters())
    for param_name, param in reference.named_parameters():
        assert rel_err(ours[param_name].detach(), param.detach()) < 1e-4, param_name
    our_buffers = dict(reloaded.named_buffers())
    for buffer_name, buffer in reference.named_buffers():
        if buffer_name.endswith("e_score_correction_bias"):  # moved by load only (or not), bit for bit
            assert torch.equal(our_buffers[buffer_name], buffer), buffer_name
    with torch.no_grad():
        assert rel_err(our_logits.cpu(), reloaded(ids).logits) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("naming", ["qwen", "gpt_oss"])
def test_gpu_grouped_experts_equal_the_expert_loop(naming):
    """bf16 on the GPU: torch._grouped_mm (one kernel per projection, no host sync) and the
    per-expert loop compute the same block, forward and backward, recomputing or from kept products, to bf16
    rounding."""
    import megatrain_templates.grouped_experts as moe_module
    from megatrain_templates import BlockShape, MoeBlock, MoeShape, RopeConfig, RouterLoad

    gpt_oss = naming == "gpt_oss"
    key = (str(torch.device("cuda")), torch.bfloat16) + (("row_major",) if gpt_oss else ())
    assert moe_module._grouped_mm_works(torch.device("cuda"), torch.bfloat16, gpt_oss), "grouped GEMMs unavailable"
    shape = BlockShape(256, 4, 2, 64, 1, rope=RopeConfig(64), sinks=gpt_oss, sliding_window=16 if gpt_oss else None)
    moe = MoeShape(16, 4, 128, 0 if gpt_oss else 192, naming=naming, norm_topk_prob=gpt_oss)
    block = MoeBlock(shape, moe, RouterLoad(16, 4, 0.01))
    weights = [(torch.randn(block.numel, device="cuda") * 0.05).bfloat16()]
    x = torch.randn(2, 64, 256, device="cuda", dtype=torch.bfloat16)
    grad_out = torch.randn_like(x)
    results = []
    for grouped in (True, False):
        moe_module._GROUPED_MM[key] = grouped
        for kept in (False, True):
            block.router_load.reset()
            out, products = block.forward_keeping_products(weights, x) if kept else (block.forward(weights, x), None)
            grads = [torch.zeros(block.numel, device="cuda")]
            grad_in = block.backward(weights, x, grad_out, grads, products=products)
            results.append((out.float(), grad_in.float(), grads[0]))
    del moe_module._GROUPED_MM[key]
    for result in results[1:]:
        for got, want in zip(result, results[0]):
            assert rel_err(got, want) < 2e-2


@pytest.mark.gpu
def test_gpu_grouped_weight_gradient_of_an_expert_no_row_chose_is_zero():
    """The grouped kernel's weight gradient (groups along the rows it sums over) is zero for an expert with no
    rows, as the loop's, not what the memory held."""
    from megatrain_templates.grouped_experts import _grouped_weight_grad, _Slots

    rows, n_experts = 48, 4
    expert = torch.tensor([0] * 16 + [2] * 32, device="cuda")  # experts 1 and 3: no rows
    a, b = (torch.randn(rows, width, device="cuda", dtype=torch.bfloat16) for width in (64, 32))
    order = torch.arange(rows, device="cuda")
    for _ in range(2):  # the second time into memory the first freed
        results = []
        for grouped in (True, False):
            slots = _Slots(order, order, expert, order, 1, n_experts, grouped)
            results.append(_grouped_weight_grad(a, b, slots).float())
        assert torch.equal(results[0][1], torch.zeros(64, 32, device="cuda"))
        assert torch.equal(results[0][3], torch.zeros(64, 32, device="cuda"))
        assert rel_err(results[0], results[1]) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("naming", ["qwen", "gpt_oss"])
def test_gpu_experts_in_parts_equal_the_whole_block(naming):
    """bf16 on the GPU with the grouped GEMMs: the layer as MoeAttention + three MoeExperts parts
    (each a host sync for its row count) computes the whole block, forward and backward, to bf16 rounding."""
    from megatrain_templates import (
        BlockShape,
        MoeAttention,
        MoeBlock,
        MoeExperts,
        MoeShape,
        RopeConfig,
        RouterLoad,
        row_slice_name,
    )

    gpt_oss = naming == "gpt_oss"
    shape = BlockShape(256, 4, 2, 64, 1, rope=RopeConfig(64), sinks=gpt_oss, sliding_window=16 if gpt_oss else None)
    moe = MoeShape(16, 4, 128, 0 if gpt_oss else 192, naming=naming, norm_topk_prob=gpt_oss)
    whole = MoeBlock(shape, moe, RouterLoad(16, 4, 0.01))
    parts = ((0, 5), (5, 11), (11, 16))
    load = RouterLoad(16, 4, 0.01)
    stages = [MoeAttention(shape, moe, load)] + [MoeExperts(shape, moe, a, b) for a, b in parts]
    flat = (torch.randn(whole.numel, device="cuda") * 0.05).bfloat16()
    offset, values = 0, {}
    for spec in whole.groups[0]:
        values[spec.name] = flat[offset : offset + spec.numel].view(spec.shape)
        offset += spec.numel
    values |= {row_slice_name(n, a, b): v[a:b] for n, v in list(values.items()) for a, b in parts if v.dim() > 0}
    weights = [[torch.cat([values[p.name].reshape(-1) for p in params]) for params in s.groups] for s in stages]
    x = torch.randn(2, 64, 256, device="cuda", dtype=torch.bfloat16)
    grad_out = torch.randn_like(x)
    want = whole.forward([flat], x)
    grads = [torch.zeros(whole.numel, device="cuda")]
    want_grad_in = whole.backward([flat], x, grad_out, grads)
    inputs, h = [], x
    for stage, w in zip(stages, weights):
        inputs.append(stage.checkpoint(h) if hasattr(stage, "checkpoint") else h)
        h = stage.forward(w, h)
    assert rel_err(h.float(), want.float()) < 2e-2
    g = grad_out
    for stage, w, h in reversed(list(zip(stages, weights, inputs))):
        g = stage.backward(w, h, g, [torch.zeros(t.numel(), device="cuda") for t in w])
    assert rel_err(g.float(), want_grad_in.float()) < 2e-2


def test_aux_loss_gradient_matches_transformers_across_micro_batches(tmp_path):
    """The load-balancing loss belongs to the whole step: one micro-batch or three give the same
    step, equal to transformers on the whole batch (gradient of the aux term included)."""
    reference = hf_model("tiny-qwen3-moe", True, 1)
    reference.save_pretrained(tmp_path / "hf")
    ids, labels = random_batch(6, 12, 256, torch.Generator().manual_seed(2))
    out = reference(input_ids=ids, labels=hf_labels(labels))
    out.loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf")).item()
    runs = []
    for micro in (6, 2):
        trainer, _ = make_trainer(tmp_path / "hf", tmp_path, 0.0, steps=1, micro_batch_size=micro)
        runs.append(trainer.train_step(StepBatch(ids, labels)))
        trainer.close()
        assert runs[-1].loss == pytest.approx(out.loss.item(), rel=1e-5)
        assert runs[-1].grad_norm == pytest.approx(norm, rel=1e-5)
    assert runs[0].grad_norm == pytest.approx(runs[1].grad_norm, rel=1e-6)
    assert runs[0].router_aux_loss == pytest.approx(runs[1].router_aux_loss, rel=1e-6)


def test_gpt_oss_routers_of_experts_no_token_picks_stay_as_transformers_leaves_them(tmp_path):
    """float32 steps of a gpt-oss with more experts than a few tokens pick: an expert no token picked in a layer
    over four steps keeps its router row as transformers' (whose softmax over the top-k logits gives it a
    gradient of exactly zero, so AdamW leaves its bias unchanged), bit for bit."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    reference = hf_model("tiny-gpt-oss", False, seed, num_local_experts=32)
    reference.save_pretrained(tmp_path / "hf")
    initial = {n: p.detach().clone() for n, p in reference.named_parameters() if n.endswith("router.bias")}
    trainer, train = make_trainer(tmp_path / "hf", tmp_path, 0.0, steps=4, batch_size=1, micro_batch_size=1)
    optimizer = hf_adamw(reference, train)
    generator = torch.Generator().manual_seed(seed)
    for step in range(train.steps):
        ids = torch.randint(0, trainer.model_config.vocab_size, (1, 3), generator=generator)
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
        metrics = trainer.train_step(StepBatch(ids, labels))
        _, loss, _ = reference_step(reference, optimizer, train, step, 0.0, input_ids=ids, labels=labels)
        assert metrics.loss == pytest.approx(loss.item(), rel=1e-5)
    ours = trainer.named_weights()
    unpicked = 0
    for name, start in initial.items():
        theirs = dict(reference.named_parameters())[name].detach()
        never = theirs == start  # no gradient in any step: AdamW left the bias as it was
        unpicked += int(never.sum())
        assert torch.equal(ours[name][never], theirs[never]), name
    trainer.close()
    assert unpicked >= 8  # of the 64 router rows, 2 layers x 32 experts (about 30 expected)


@pytest.mark.parametrize("experts_per_stage", ["auto", 3])
def test_fused_expert_layout_imports(experts_per_stage, tmp_path):
    """transformers' in-memory layout (experts as [n_experts, 2 * d_ff, d_model] gate_up_proj and
    [n_experts, d_model, d_ff] down_proj) written as is imports to the same model."""
    reference = hf_model("tiny-mixtral", False, 3)
    reference.save_pretrained(tmp_path / "hf")
    tensors = {n: t.detach().clone().contiguous() for n, t in reference.state_dict().items()}
    (tmp_path / "fused").mkdir()
    save_file(tensors, str(tmp_path / "fused" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    assert any(n.endswith("experts.gate_up_proj") for n in tensors)
    engine = EngineSection(experts_per_stage=experts_per_stage)  # 3: each fused tensor spans two groups
    trainer, _ = make_trainer(tmp_path / "fused", tmp_path, 0.0, steps=1, engine=engine)
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        assert rel_err(trainer.logits(ids), reference.eval()(ids).logits) < 1e-5
    trainer.close()


def test_checkpoint_with_wrong_expert_count_is_refused_before_allocation(tmp_path):
    reference = hf_model("tiny-qwen3-moe", False, 4)
    reference.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    for key in ("num_experts", "num_local_experts"):  # the weights hold 8
        if key in config:
            config[key] = 6
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(StoreError, match=r"experts\.(6|7)\.\w+\.weight"):
        make_trainer(tmp_path / "hf", tmp_path, 0.0, steps=1)


def test_megatrain_train_matches_transformers(tmp_path):
    """`megatrain train` end to end (windows of a token file, no shuffling) gives transformers' losses."""
    from megatrain.cli import main

    reference = hf_model("tiny-olmoe", True, 5)
    reference.save_pretrained(tmp_path / "hf")
    tokens = np.random.default_rng(5).integers(0, 256, 4 * 4 * 16).astype(np.int32)
    np.save(tmp_path / "tokens.npy", tokens)
    config = {
        "model": {"hf_dir": str(tmp_path / "hf")},
        "data": {"tokens": str(tmp_path / "tokens.npy"), "seq_len": 16, "shuffle": False},
        "train": {
            "steps": 3,
            "batch_size": 4,
            "micro_batch_size": 2,
            "lr": 1e-4,
            "schedule": "constant",
            "grad_clip": 1.0,
        },
        "precision": {"compute_dtype": "float32"},
        "device": "cpu",
        "output_dir": str(tmp_path / "run"),
    }
    (tmp_path / "config.yaml").write_text(json.dumps(config))  # JSON is YAML
    assert main(["train", "--config", str(tmp_path / "config.yaml")]) == 0
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    optimizer = hf_adamw(reference, TrainSection(lr=1e-4))
    windows = torch.from_numpy(tokens.astype(np.int64)).view(-1, 16)
    for step, loss in enumerate(losses):
        ids = windows[step * 4 : (step + 1) * 4]
        optimizer.zero_grad()
        out = reference(input_ids=ids, labels=ids)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        optimizer.step()
        assert loss == pytest.approx(out.loss.item(), rel=1e-5)


@pytest.mark.parametrize("experts_per_stage", ["auto", 3])
def test_mxfp4_experts_are_dequantized_on_import(experts_per_stage, tmp_path):
    """gpt-oss publishes its experts in MXFP4 (blocks + scales): they load, dequantized exactly as
    transformers dequantizes them, into the fp32 masters; the config's quantization_config is accepted."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from megatrain_zoo.hf_weights import dequantize_mxfp4, mxfp4_shapes

    reference = hf_model("tiny-gpt-oss", False, 6)
    reference.save_pretrained(tmp_path / "hf")
    (weights,) = (tmp_path / "hf").glob("*.safetensors")
    tensors = load_file(str(weights))
    generator = torch.Generator().manual_seed(6)
    expected = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks_shape, scales_shape = mxfp4_shapes(tuple(tensors.pop(name).shape))
        blocks = torch.randint(0, 256, blocks_shape, generator=generator, dtype=torch.uint8)
        scales = torch.randint(120, 130, scales_shape, generator=generator, dtype=torch.uint8)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        expected[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert torch.equal(dequantize_mxfp4(blocks, scales), expected[name])
    save_file(tensors, str(weights), metadata={"format": "pt"})
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    engine = EngineSection(experts_per_stage=experts_per_stage)  # 3: row slices of each tensor in two groups
    trainer, _ = make_trainer(tmp_path / "hf", tmp_path, 0.0, steps=1, engine=engine)
    ours = trainer.named_weights()
    for name, value in expected.items():
        assert torch.equal(ours[name], value), name
    assert torch.equal(ours["model.embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    trainer.close()
    if experts_per_stage == "auto":  # `megatrain convert` writes the experts dequantized too
        from megatrain.export import convert

        written = load_file(str(convert(tmp_path / "hf", tmp_path / "converted") / "model.safetensors"))
        for name, value in expected.items():
            assert torch.equal(written[name], value), name
        assert not any(name.endswith(("_blocks", "_scales")) for name in written)


@pytest.mark.parametrize("experts_per_stage", ["auto", 3])
def test_fp8_checkpoints_are_dequantized_on_import(experts_per_stage, tmp_path):
    """DeepSeek-V3 publishes its matrices in block-scaled FP8 (e4m3 + an inverse scale per tile) and
    its multi-token-prediction module as a layer past the last: the matrices load as transformers
    dequantizes them, the extra layer is left out, as there. (transformers takes tiles that divide the
    matrix; the tiles that overhang it, as DeepSeek-V3's 576-row kv_a_proj_with_mqa, below.)"""
    from safetensors.torch import load_file

    reference = hf_model("tiny-deepseek-v3", False, 7)
    reference.save_pretrained(tmp_path / "hf")
    (weights,) = (tmp_path / "hf").glob("*.safetensors")
    tensors = load_file(str(weights))
    block, generator = 4, torch.Generator().manual_seed(7)
    matrices = [n for n, t in tensors.items() if ".layers." in n and t.dim() == 2 and not n.endswith("gate.weight")]
    for name in matrices:  # as published: every matrix of a layer but the router
        rows, cols = tensors[name].shape
        scale_inv = 0.001 + 0.01 * torch.rand(-(-rows // block), -(-cols // block), generator=generator)
        tiles = scale_inv.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
        tensors[name] = (tensors[name] / tiles).to(torch.float8_e4m3fn)
        tensors[f"{name}_scale_inv"] = scale_inv
    tensors["model.layers.3.eh_proj.weight"] = torch.randn(64, 128)  # the multi-token-prediction layer
    save_file(tensors, str(weights), metadata={"format": "pt"})
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block]}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    dequantized = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf",
        quantization_config=transformers.FineGrainedFP8Config(dequantize=True, weight_block_size=(block, block)),
        dtype=torch.float32,
    ).eval()
    engine = EngineSection(experts_per_stage=experts_per_stage)
    trainer, _ = make_trainer(tmp_path / "hf", tmp_path, 0.0, steps=1, engine=engine)
    ours = trainer.named_weights()
    theirs = dict(dequantized.state_dict())
    experts = "model.layers.1.mlp.experts."  # fused in transformers: [expert, gate rows + up rows, d_model]
    for e in range(8):
        theirs[f"{experts}{e}.gate_proj.weight"], theirs[f"{experts}{e}.up_proj.weight"] = theirs[
            f"{experts}gate_up_proj"
        ][e].chunk(2)
        theirs[f"{experts}{e}.down_proj.weight"] = theirs[f"{experts}down_proj"][e]
    compared = [name for name in matrices if ".layers.1." in name]
    assert len(compared) == 5 + 3 + 3 * 8  # attention, shared expert, experts
    for name in compared:
        assert torch.equal(ours[name], theirs[name]), name
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        assert rel_err(trainer.logits(ids), dequantized(ids).logits) < 1e-5
    trainer.close()
    if experts_per_stage == "auto":  # `megatrain convert` writes such a directory dequantized too
        from megatrain.export import convert

        written = load_file(str(convert(tmp_path / "hf", tmp_path / "converted") / "model.safetensors"))
        assert not any(name.endswith("_scale_inv") or ".layers.3." in name for name in written)
        converted = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "converted", dtype=torch.float32)
        with torch.no_grad():
            assert torch.equal(converted(ids).logits, dequantized(ids).logits)


def test_fp8_tiles_that_overhang_the_matrix_scale_what_they_cover():
    """DeepSeek's own dequantization (inference/kernel.py): ceil(rows / 128) x ceil(cols / 128) scales,
    the last row and column of tiles cut off at the matrix's edge; also for a group's rows alone."""
    from megatrain_zoo.hf_weights import dequantize_fp8_blocks

    weight = torch.randn(40, 20).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(3, 2) + 0.5  # 16 x 16 tiles: 40 = 16 + 16 + 8 rows, 20 = 16 + 4 columns
    expected = weight.float().clone()
    for i in range(40):
        for j in range(20):
            expected[i, j] *= scale_inv[i // 16, j // 16]
    assert torch.equal(dequantize_fp8_blocks(weight, scale_inv, (16, 16)), expected)
    assert torch.equal(dequantize_fp8_blocks(weight[20:], scale_inv[1:], (16, 16), first_row=4), expected[20:])


@pytest.mark.gpu
@pytest.mark.parametrize("chunked", [False, True], ids=["sinks-and-window", "chunks"])
@pytest.mark.parametrize("packed", [False, True])
def test_gpu_flex_attention_equals_eager(packed, chunked):
    """gpt-oss' attention on CUDA (FlexAttention, sinks through its log-sum-exp), and Llama 4's chunked attention
    (chunks by each document's positions), equal the written-out attention on the CPU, forward and backward,
    fp32, with and without packed documents."""
    from megatrain_templates import Documents
    from megatrain_templates.attention import masked_attention

    torch.backends.cuda.matmul.allow_tf32 = False
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 40, 16, generator=generator)
    k, v = torch.randn(2, 2, 40, 16, generator=generator), torch.randn(2, 2, 40, 16, generator=generator)
    sinks, grad_out = torch.randn(4, generator=generator), torch.randn(2, 4, 40, 16, generator=generator)
    positions = torch.cat([torch.arange(17), torch.arange(23)]).expand(2, -1) if packed else None
    results = []
    for device in ("cpu", "cuda"):
        inputs = [t.detach().to(device).requires_grad_(True) for t in (q, k, v) + (() if chunked else (sinks,))]
        documents = None if positions is None else Documents(positions.to(device))
        if chunked:
            out = masked_attention(*inputs, documents=documents, chunk=6)
        else:
            out = masked_attention(*inputs, window=5, documents=documents)
        out.backward(grad_out.to(device))
        results.append([out.detach().cpu()] + [t.grad.cpu() for t in inputs])
    for ours, reference in zip(results[1], results[0]):
        assert rel_err(ours, reference) < 1e-5


def test_padding_is_left_out_of_the_load_balancing_loss_as_transformers_does(tmp_path):
    """Fine-tuning rows padded to seq_len: transformers, given the attention mask, leaves padding out of
    the routing statistics; so does megatrain, given the rows' real tokens (steps, aux loss, gradients)."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    reference = hf_model("tiny-qwen3-moe", True, seed)
    reference.save_pretrained(tmp_path / "hf")
    trainer, train = make_trainer(tmp_path / "hf", tmp_path, 0.5, steps=2, batch_size=4, micro_batch_size=2)
    optimizer = hf_adamw(reference, train)
    generator = torch.Generator().manual_seed(seed)
    for step in range(train.steps):
        ids, labels = random_batch(4, 12, trainer.model_config.vocab_size, generator)
        lengths = torch.randint(5, 13, (4, 1), generator=generator)
        valid = torch.arange(12).unsqueeze(0) < lengths
        ids, labels = ids.masked_fill(~valid, 0), labels.masked_fill(~valid, -100)
        labels[:, :-1] = labels[:, :-1].masked_fill(~valid[:, 1:], -100)  # no target is a padding token
        metrics = trainer.train_step(StepBatch(ids, labels, None, valid))
        out, _, norm = reference_step(
            reference, optimizer, train, step, 0.5, input_ids=ids, attention_mask=valid.long(), labels=labels
        )
        assert metrics.router_aux_loss == pytest.approx(out.aux_loss.item(), rel=1e-5)
        assert metrics.loss == pytest.approx(out.loss.item(), rel=1e-5)
        assert metrics.grad_norm == pytest.approx(norm.item(), rel=1e-5)
    trainer.close()


@pytest.mark.parametrize(
    "name, saved, resumed", [("tiny-gpt-oss", 3, "auto"), ("tiny-gpt-oss", "auto", 2), ("tiny-deepseek-v3", 3, "auto")]
)
def test_checkpoints_resume_whatever_the_experts_parts(name, saved, resumed, tmp_path):
    """Checkpoint files name tensors as transformers does (gpt-oss' row slices joined, DeepSeek-V3's
    split-precision bias summed), so a run saved with its experts in parts resumes with whole layers or
    other parts: the same loss and weights to fp32 rounding (the parts sum the experts' outputs and the
    clipping norm the groups' squared norms in another order). DeepSeek-V3's biases move by load on both sides."""
    from megatrain.checkpoint import resolve_resume, save_checkpoint

    reference = hf_model(name, True, 7)
    reference.save_pretrained(tmp_path / "hf")
    generator = torch.Generator().manual_seed(7)
    batches = [random_batch(6, 12, 256, generator) for _ in range(3)]
    rate = 0.01 if name in BIASED_PRESETS else 0.0
    first, _ = make_trainer(
        tmp_path / "hf", tmp_path, 0.5, 3, engine=EngineSection(experts_per_stage=saved), router_bias_update_rate=rate
    )
    for ids, labels in batches[:2]:
        first.train_step(StepBatch(ids, labels))
    checkpoint = save_checkpoint(first.state_dict(), tmp_path / "checkpoints")
    expected = first.train_step(StepBatch(*batches[2])).loss
    want = first.named_weights()
    first.close()
    second, _ = make_trainer(
        tmp_path / "hf", tmp_path, 0.5, 3, engine=EngineSection(experts_per_stage=resumed), router_bias_update_rate=rate
    )
    second.load_state_dict(resolve_resume(checkpoint).state())
    assert second.train_step(StepBatch(*batches[2])).loss == pytest.approx(expected, rel=1e-6)
    got = second.named_weights()
    assert got.keys() == want.keys()
    for name in want:
        assert rel_err(got[name], want[name]) < 1e-6, name
    second.close()


@pytest.mark.parametrize("name", ["tiny-gpt-oss", "tiny-qwen2-moe"])
def test_random_initialisation_does_not_depend_on_the_parts(name, tmp_path):
    """A preset's weights come from the seed alone, whatever the layout: each tensor draws from a
    generator of its own, expert by expert for gpt-oss' fused tensors and their row slices."""
    weights = []
    for experts_per_stage in ("auto", 3):
        config = Config(
            model=ModelSection(preset=name),
            data=DataSection(seq_len=12),
            train=TrainSection(seed=11),
            precision=PrecisionSection("float32"),
            engine=EngineSection(experts_per_stage=experts_per_stage),
            device="cpu",
            output_dir=str(tmp_path / "run"),
        )
        trainer = Trainer(config, training=False)
        weights.append(trainer.named_weights())
        trainer.close()
    assert weights[0].keys() == weights[1].keys()
    for tensor_name, tensor in weights[0].items():
        assert torch.equal(tensor, weights[1][tensor_name]), tensor_name
    if name == "tiny-gpt-oss":  # biases start at zero, also as row slices
        assert not weights[1]["model.layers.0.mlp.experts.gate_up_proj_bias"].any()


def test_ernie_multi_token_prediction_tensors_are_left_out_as_transformers_does(tmp_path, capsys):
    """ERNIE-4.5's published checkpoints carry `mtp` modules that transformers' model does not load: megatrain
    leaves them out too, says so, and trains the rest; `megatrain convert` writes it without them."""
    extra = {
        "model.mtp_block.0.mlp.gate_proj.weight": torch.randn(96, 64),
        "model.mtp_linear_proj.0.weight": torch.randn(64, 128),
    }
    reference = hf_model("tiny-ernie4_5-moe", False, 3).eval()
    check_extra_tensors_are_left_out(reference, extra, "multi-token-prediction modules", tmp_path, capsys)
