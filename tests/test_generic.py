"""Families megatrain has no template for train through transformers' own modules exactly like transformers: several
optimizer steps of megatrain (fp32, micro-batches, clipped and eager, weight decay on matrices) equal the family's
*ForCausalLM + torch.optim.AdamW on the same batches; dense decoders with learned positions, parallel blocks,
sliding windows, partial rotary embedding and biases; hybrids of attention and Mamba or convolutions; mixtures of
experts; exports load in transformers with equal weights and logits. A native family run through transformers equals
its native template; a model the generic path cannot train is refused in one line."""

from contextlib import nullcontext
from dataclasses import replace

import numpy as np
import pytest
import torch
import transformers  # installed by the integration nox session
from hf_steps import random_batch, reference_step, rel_err

from megatrain import Trainer
from megatrain.cli import main
from megatrain.config import Config, ConfigError, EngineSection, ModelSection, PrecisionSection, TrainSection
from megatrain.step import StepBatch
from megatrain_data import DataSection
from megatrain_zoo import GenericError, TemplateLacks, ZooError, model_config_from_hf
from megatrain_zoo.generic import generic_notes

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
FAMILIES = {
    # dense: learned positions, LayerNorm with biases, a tied head
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, vocab_size=256, bos_token_id=1, eos_token_id=2),
    # blocks returning a list (GPT-1), a forward reading `outputs[0]` (GPT-Neo: a bare tensor's first row would
    # pass for a one-token trace), token embeddings narrower than the layers (OPT's projections in and out)
    "openai-gpt": dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, vocab_size=256),
    "gpt_neo": dict(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        attention_types=[[["global", "local"], 1]],
        window_size=4,
        max_position_embeddings=256,
        vocab_size=256,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "opt": dict(ffn_dim=128, word_embed_proj_dim=32),
    # a get_decoder() that returns the LM head (ModernBERT's decoder names it `decoder`)
    "modernbert-decoder": dict(
        layer_types=["full_attention", "sliding_attention"], sliding_window=4, cls_token_id=200, sep_token_id=201
    ),
    # a text-only checkpoint of an image-text family (vision_config null), its wrapper's forward replacing image
    # and audio tokens (200-206: in the random batches) by padding before the decoder
    "gemma4_unified": dict(
        text_config=dict(
            COMMON,
            model_type="gemma4_unified_text",
            head_dim=16,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            tie_word_embeddings=True,
        ),
        vision_config=None,
        audio_config=None,
        **dict(boi_token_id=200, eoi_token_id=201, image_token_id=202, video_token_id=203, boa_token_id=204),
        **dict(eoa_token_index=205, audio_token_id=206),
    ),
    # Gemma 4's 31B and 26B-A4B (this one's experts beside each layer's MLP): sliding layers 16 wide, full layers
    # 32 (global_head_dim) with one key/value head whose values are its keys (attention_k_eq_v) and a quarter
    # rotary; no per-layer embeddings or shared keys and values (the E2B and E4B have them: refused)
    "gemma4_text": dict(
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        hidden_size_per_layer_input=0,
        num_kv_shared_layers=0,
        **dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32),
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
    ),
    "cohere2": dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"], logit_scale=0.5),
    "exaone4": dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    "seed_oss": dict(head_dim=16, attention_bias=True),
    "stablelm": dict(partial_rotary_factor=0.25, use_qkv_bias=True),
    "starcoder2": dict(sliding_window=4, use_bias=True),
    "glm4": dict(head_dim=16),
    "olmo": dict(clip_qkv=1.0),
    "nemotron": dict(head_dim=16, partial_rotary_factor=0.5),
    "helium": dict(head_dim=16),
    "hunyuan_v1_dense": dict(head_dim=16),
    # parameters and persistent buffers in nested submodules: Apertus' xIELU activation (learned alpha_p and
    # alpha_n, constant beta and eps inside mlp.act_fn), BitNet's norms inside its attention and MLP
    "apertus": dict(head_dim=16),
    "bitnet": dict(head_dim=16),
    # hybrids: attention beside Mamba-2 or short convolutions
    "falcon_h1": dict(mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8, mamba_d_state=16, mamba_chunk_size=4),
    "lfm2": dict(layer_types=["conv", "full_attention"], block_ff_dim=128, block_auto_adjust_ff_dim=False),
    "recurrent_gemma": dict(lru_width=64, block_types=["recurrent", "attention"], attention_window_size=4, head_dim=16),
    "jamba": dict(
        num_experts=4,
        num_experts_per_tok=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        mamba_d_state=8,
        mamba_dt_rank=8,
        output_router_logits=False,
    ),
    "bamba": dict(
        attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=8, mamba_d_state=16, mamba_chunk_size=4, mamba_expand=1
    ),
    # a native family (Granite 4.0) whose experts its template lacks: auto trains it through transformers instead
    "granitemoehybrid": dict(
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["mamba", "attention"],
        **dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=4),
    ),
    # mixtures of experts (their load-balancing loss left off: see test_a_load_balancing_loss_is_refused)
    "jetmoe": dict(num_local_experts=4, num_experts_per_tok=2, kv_channels=16, output_router_logits=False),
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=False),
    # each layer two attentions (num_hidden_layers counts both: twice the layers); latent attention, zero experts
    "longcat_flash": dict(
        num_hidden_layers=4,
        num_key_value_heads=4,
        ffn_hidden_size=128,
        **dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, head_dim=16),
        **dict(moe_topk=2, n_routed_experts=4, zero_expert_num=2, expert_ffn_hidden_size=32),
    ),
    # a checkpoint's fused query_key_value, split by transformers' converter into q_proj, k_proj and v_proj
    "param2moe": dict(
        head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32
    ),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=False),
    # (its top-k per layer, as Hunyuan-A13B's config.json gives it; none of 1, whose weight normalised to 1 gives
    # the router only fp32 noise for a gradient, which AdamW scales up into routes differing from transformers')
    "hunyuan_v1_moe": dict(head_dim=16, num_experts=4, moe_topk=[2, 3], num_shared_expert=[1, 1]),
    # (a routing bias, a persistent buffer, inside each layer's feed_forward; short convolutions between)
    "lfm2_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        num_dense_layers=0,
        layer_types=["conv", "full_attention"],
    ),
}


OWN_SIZE_NAMES = {
    "gpt2",
    "openai-gpt",
    "gpt_neo",
    "gemma4_unified",
}  # (families whose configs name their sizes their own way)


def tiny_hf_config(model_type: str) -> dict:
    extra = FAMILIES[model_type]
    common = {} if model_type in OWN_SIZE_NAMES else COMMON
    return {"model_type": model_type, **common, **extra}


def hf_model(hf_config: dict, seed: int):
    """transformers' model of `hf_config` with fresh random weights: norms around 1, the rest around 0, large enough
    that every part changes the result; its persistent floating-point buffers (Apertus' xIELU beta and eps, a
    router's bias) moved off their defaults, so that only a model computing with the checkpoint's equals it; in eval
    mode, as megatrain trains (no dropout, no router jitter); in SDPA where the family has it."""
    config = transformers.AutoConfig.for_model(**hf_config)
    torch.manual_seed(seed)
    try:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    except ValueError as error:  # (a family without SDPA, GPT-1: eager, as megatrain's skeleton chooses)
        if "scaled_dot_product_attention" not in str(error):
            raise
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 and ("norm" in name or "ln" in name) and name.endswith("weight"):
                param.normal_(1.0, 0.2)
            else:
                param.normal_(0.0, 0.15)
        for buffer in persistent_buffers(model).values():
            if buffer.is_floating_point():
                buffer.mul_(1 + 0.2 * torch.randn_like(buffer)).add_(0.01 * torch.randn_like(buffer))
    return model.eval()


def persistent_buffers(model) -> dict:
    """The buffers transformers saves beside the parameters, by name."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return {name: value for name, value in model.state_dict(keep_vars=True).items() if name not in params}


def adamw_decaying_matrices(model, train: TrainSection):
    """torch's AdamW with the generic path's rule: matrices decay, vectors (norms, biases, Mamba's A_log and D) do
    not."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": train.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=train.lr, betas=train.betas, eps=train.eps)


def generic_trainer(
    hf_dir,
    tmp_path,
    grad_clip: float,
    steps: int = 3,
    implementation: str = "auto",
    device: str = "cpu",
    engine: EngineSection = EngineSection(),
    image_text: str | bool = "auto",
) -> Trainer:
    train = TrainSection(
        steps=steps,
        batch_size=6,
        micro_batch_size=2,
        lr=1e-4,  # (fp32 noise in gradients that are zero in exact arithmetic, k_proj.bias, stays small)
        weight_decay=0.1,
        grad_clip=grad_clip,
        warmup_steps=1,
        schedule="cosine",
    )
    config = Config(
        model=ModelSection(hf_dir=str(hf_dir), implementation=implementation, image_text=image_text),
        data=DataSection(seq_len=12),
        train=train,
        precision=PrecisionSection("float32"),
        device=device,
        engine=engine,
        output_dir=str(tmp_path / "run"),
    )
    return Trainer(config)


def check_trains_like_transformers(
    model_type: str, tmp_path, grad_clip: float, device: str = "cpu", engine: EngineSection = EngineSection()
):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    reference = hf_model(tiny_hf_config(model_type), seed)
    reference.save_pretrained(tmp_path / "hf")
    trainer = generic_trainer(tmp_path / "hf", tmp_path, grad_clip, device=device, engine=engine)
    assert trainer.model_config.implementation == "transformers"
    assert trainer.model_config.n_params == sum(p.numel() for p in reference.parameters())
    train = trainer.config.train
    optimizer = adamw_decaying_matrices(reference, train)
    generator = torch.Generator().manual_seed(seed)
    noise_only = {}  # name -> elements whose gradient is zero in exact arithmetic (fp32 noise, AdamW scales it)
    for step in range(train.steps):
        ids, labels = random_batch(train.batch_size, 12, 256, generator)
        metrics = trainer.train_step(StepBatch(ids, labels))
        _, loss, norm = reference_step(reference, optimizer, train, step, grad_clip, input_ids=ids, labels=labels)
        assert metrics.loss == pytest.approx(loss.item(), rel=1e-5), step
        assert metrics.grad_norm == pytest.approx(norm.item(), rel=1e-4), step
        if engine.kept_layers != "auto":  # (the layers keeping their graphs: on the device and in host memory)
            kept = trainer.pipeline.executed
            assert (len(kept.keeping), len(kept.host_kept)) == (engine.kept_layers + engine.host_kept_layers, 1)
        for name, p in reference.named_parameters():
            noise_only[name] = noise_only.get(name, False) | (p.grad.abs() < 1e-7 * norm)
    ids = torch.randint(0, 256, (2, 12), generator=generator)
    our_logits = trainer.logits(ids).cpu()
    exported = trainer.export(tmp_path / "out")
    trainer.close()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    ours = dict(reloaded.named_parameters())
    for name, param in reference.named_parameters():
        # (the key bias's gradient, but where rotated, is zero in exact arithmetic: AdamW scales its noise up)
        signal = ~noise_only[name]
        assert rel_err(ours[name].detach()[signal], param.detach()[signal]) < 1e-4, name
    reloaded_buffers = persistent_buffers(reloaded)
    for name, buffer in persistent_buffers(reference).items():  # (the checkpoint's, exported as they came)
        assert torch.equal(reloaded_buffers[name].to(buffer.dtype), buffer), name
    with torch.no_grad():
        assert rel_err(our_logits, reloaded(ids).logits) < 1e-5
        assert rel_err(our_logits, reference(ids).logits) < 1e-4


@pytest.mark.parametrize("grad_clip", [0.5, 0.0], ids=["clipped", "eager"])
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_steps_match_transformers(model_type, grad_clip, tmp_path):
    check_trains_like_transformers(model_type, tmp_path, grad_clip)


@pytest.mark.parametrize("model_type", ["gpt2", "cohere2", "falcon_h1", "lfm2", "jamba", "phimoe", "hunyuan_v1_moe"])
def test_layers_keeping_their_graphs_match_transformers(model_type, tmp_path):
    """Layers keeping their forward's graph for the backward (its saved tensors as products: on the device for
    one layer, in host memory for the other) recompute nothing and train the same."""
    check_trains_like_transformers(model_type, tmp_path, 0.5, engine=EngineSection(kept_layers=1, host_kept_layers=1))


@pytest.fixture
def compiled_as_on_a_gpu(monkeypatch) -> list[str]:
    """The generic layers run through torch.compile as on CUDA, but with Inductor's partitioner alone (no code
    generated: the CPU has no Triton): the trace and the split of each layer's forward and backward a GPU run
    trains with. Gives the backends asked for."""
    from megatrain_zoo import generic_stages

    asked, partitioned = [], generic_stages._compiled_layer_call("aot_eager_decomp_partition")
    monkeypatch.setattr(generic_stages.GenericLayer, "runs_compiled", lambda self, device: True)
    monkeypatch.setattr(generic_stages, "_compiled_layer_call", lambda backend: asked.append(backend) or partitioned)
    return asked


# (falcon_h1 and jamba pass too, but their Mamba layers take about a minute each to trace on two cores:
# `pytest tests/test_generic.py -k compiled_as_on_a_gpu` with them added)
@pytest.mark.parametrize("model_type", ["stablelm", "lfm2", "gemma4_text"])
def test_layers_compiled_as_on_a_gpu_match_transformers(model_type, compiled_as_on_a_gpu, tmp_path):
    """Families the GPU tests run eagerly, compiled as a GPU run compiles them, one layer's graph kept on the device
    and one in host memory: trained as transformers does."""
    engine = EngineSection(kept_layers=1, host_kept_layers=1)
    check_trains_like_transformers(model_type, tmp_path, 0.5, engine=engine)
    assert compiled_as_on_a_gpu and set(compiled_as_on_a_gpu) == {"inductor"}


# (Inductor compiles each family's layers for tens of seconds: these compile, the rest run eagerly, as layers with
# adapters and runs with engine.compile off do)
COMPILED_ON_GPU = ("gpt2", "cohere2", "phimoe")


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["gpt2", "cohere2", "stablelm", "falcon_h1", "lfm2", "phimoe", "jamba"])
def test_gpu_steps_match_transformers(model_type, tmp_path):
    """The CUDA engine in fp32 (TF32 off) through transformers' modules, compiled by Inductor or eager, against
    transformers on the CPU."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    engine = EngineSection(compile=model_type in COMPILED_ON_GPU)
    check_trains_like_transformers(model_type, tmp_path, 0.5, "cuda", engine)


@pytest.mark.gpu
def test_gpu_compiled_layers_keeping_their_graphs_match_transformers(tmp_path):
    """Compiled layers keeping their forward's graph (its saved tensors, as Inductor's partitioner chose them, the
    products: on the device for one layer, in host memory for the other) train as transformers does."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    engine = EngineSection(kept_layers=1, host_kept_layers=1)
    check_trains_like_transformers("cohere2", tmp_path, 0.5, "cuda", engine)


@pytest.mark.gpu
def test_gpu_rates_are_measured_per_kind_of_layer(monkeypatch):
    """A generic model's layer rates on the GPU: one layer of each kind timed (Jamba's Mamba layer and its attention
    and experts layer), recomputing and keeping its graph, and the head's."""
    from megatrain_plan import rates

    timed = []
    sustained_seconds = rates._sustained_seconds
    monkeypatch.setattr(rates, "_sustained_seconds", lambda *args: timed.append(sustained_seconds(*args)) or timed[-1])
    model = model_config_from_hf(tiny_hf_config("jamba"))
    layer_tflops, kept_tflops, head_tflops, _ = rates.measure_block_rates(model, 64, 2)
    assert len(timed) == 5 and min(layer_tflops, kept_tflops, head_tflops) > 0


def tiny_qwen2_layer():
    """The first decoder layer of a tiny Qwen2 through transformers' own modules (a generic template)."""
    from megatrain_zoo import build_model

    config = model_config_from_hf({**COMMON, "model_type": "qwen2"}, implementation="transformers")
    return build_model(config).stages[1].template


def test_a_compiled_layer_keeps_only_what_costs_flops_and_gives_eager_gradients():
    """A layer run through torch.compile (on CUDA Inductor; here its partitioner without code generation) keeps its
    matmul and attention outputs for the backward, not its norms' and activation's: fewer bytes a token than eager,
    as the planner counts them; its backward from those kept products gives eager's gradients (float64)."""
    from megatrain_templates.kept_graph import KeptGraphs

    layer = tiny_qwen2_layer()
    partitioned = "aot_eager_decomp_partition"
    assert 0 < layer._product_bytes(torch.bfloat16, partitioned) < 0.6 * layer._product_bytes(torch.bfloat16)
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    weights = [torch.randn(layer.numel, generator=generator, dtype=torch.float64) * 0.1]
    x = torch.randn(2, 12, 64, generator=generator, dtype=torch.float64)
    grad_out = torch.randn(2, 12, 64, generator=generator, dtype=torch.float64)

    views = layer.weights(weights, grad=True)
    kept = KeptGraphs()
    leaves = [views[name] for name in layer.names]
    out, products = kept.forward(lambda x: layer._call(views, x, None, backend=partitioned), x, weights, leaves)
    compiled = kept.backward(products, x, weights, grad_out)

    views = layer.weights(weights, grad=True)
    x_leaf = x.clone().requires_grad_(True)
    eager_out = layer._call(views, x_leaf, None)
    eager = torch.autograd.grad(eager_out, [x_leaf, *(views[name] for name in layer.names)], grad_out)
    assert rel_err(out, eager_out.detach()) < 1e-12
    for ours, theirs in zip(compiled, eager, strict=True):
        assert rel_err(ours, theirs) < 1e-12


def test_the_planners_trace_skips_the_gemms_of_its_zero_weights_and_counts_the_same_bytes(monkeypatch):
    """The planner's trace of a layer's saved products runs its matrix products with the zero weights of no memory
    uncomputed (`_ZeroProductsUncomputed`): the same results (zeros, or addmm's bias) as computed, and the same bytes
    a token counted, in float32 and bfloat16 (on the CPU a Qwen2.5-7B layer's took minutes in bf16)."""
    from megatrain_zoo import generic_stages
    from megatrain_zoo.generic_stages import _ZeroProductsUncomputed, _zeros_of_little_memory

    rng = np.random.default_rng(3)
    x, batched, bias = (torch.tensor(rng.standard_normal(shape)) for shape in ((5, 7), (2, 5, 7), (3,)))
    zeros = _zeros_of_little_memory((7, 3), torch.float64).detach()
    stacked = _zeros_of_little_memory((2, 7, 3), torch.float64).detach().contiguous()
    with _ZeroProductsUncomputed() as mode:
        skipped = (x @ zeros, torch.addmm(bias, x, zeros), torch.nn.functional.linear(x, zeros.T, bias))
        computed = torch.bmm(batched, stacked)  # (a zero operand with memory of its own: computed)
    assert mode.skipped == 3
    expected = (x @ zeros.contiguous(), torch.addmm(bias, x, zeros.contiguous()), bias.expand(5, 3))
    for ours, theirs in zip(skipped, expected, strict=True):
        assert torch.equal(ours, theirs)
    assert torch.equal(computed, torch.zeros(2, 5, 3, dtype=torch.float64))
    counted = {dtype: tiny_qwen2_layer()._product_bytes(dtype) for dtype in (torch.float32, torch.bfloat16)}
    monkeypatch.setattr(generic_stages, "_ZeroProductsUncomputed", nullcontext)
    for dtype, count in counted.items():
        assert count > 0 and tiny_qwen2_layer()._product_bytes(dtype) == count


def test_a_kind_of_layer_torch_compile_cannot_trace_runs_eagerly(monkeypatch):
    """Where torch.compile fails on a kind of layer as the planner counts its products, that kind runs eagerly
    (and its products are counted as eager ones)."""
    from megatrain_zoo import generic_stages

    def fails(backend):
        def call(*args):
            raise RuntimeError(f"{backend} cannot trace this layer")

        return call

    layer = tiny_qwen2_layer()
    eager = layer._product_bytes(torch.float32)
    monkeypatch.setattr(generic_stages, "KINDS_RUN_EAGERLY", set())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(generic_stages, "_compiled_layer_call", fails)
    assert layer.runs_compiled(torch.device("cuda"))
    assert layer.product_bytes_per_token(4) == eager
    assert not layer.runs_compiled(torch.device("cuda"))


def test_a_kind_of_layer_inductor_fails_to_compile_runs_eagerly_from_then_on(monkeypatch, capsys):
    """Where Inductor fails on a layer in a run, the layer runs eagerly (the same output), as do layers of its kind
    from then on, and the run says so once."""
    from megatrain_zoo import generic_stages

    class InductorFailed(torch._dynamo.exc.BackendCompilerFailed):
        def __init__(self, inner_exception: Exception):  # (the base's arguments differ from torch to torch)
            RuntimeError.__init__(self, f"backend='inductor' raised:\n{inner_exception}")
            self.inner_exception = inner_exception

    calls = []

    def failing_compile(backend):
        def call(*args):
            calls.append(backend)
            raise InductorFailed(TypeError("codegen of a scan failed"))

        return call

    layer = tiny_qwen2_layer()
    monkeypatch.setattr(generic_stages, "KINDS_RUN_EAGERLY", set())
    monkeypatch.setattr(generic_stages, "_compiled_layer_call", failing_compile)
    monkeypatch.setattr(generic_stages, "compiling", lambda: True)
    weights = [torch.randn(layer.numel) * 0.1]
    x = torch.randn(2, 12, 64)
    eager = layer.forward(weights, x)  # (on the CPU: eager)
    with monkeypatch.context() as on_a_gpu:
        on_a_gpu.setattr(generic_stages.GenericLayer, "runs_compiled", lambda self, device: True)
        assert torch.equal(layer.forward(weights, x), eager)
    assert calls == ["inductor"] and layer.kind in generic_stages.KINDS_RUN_EAGERLY
    assert not layer.runs_compiled(torch.device("cuda"))
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("megatrain:")]
    assert (
        len(said) == 1 and "torch.compile failed on Qwen2DecoderLayer (TypeError: codegen of a scan failed)" in said[0]
    )


def test_layers_with_a_mamba_mixer_run_eagerly_on_a_gpu(monkeypatch):
    """Jamba's Mamba layers run eagerly on a GPU, its attention layers compiled: what Dynamo would trace of a Mamba
    mixer is transformers' reference scan in torch (see `GenericLayer.runs_compiled`)."""
    from megatrain_zoo import build_model, generic_stages

    monkeypatch.setattr(generic_stages, "compiling", lambda: True)
    layers = [stage.template for stage in build_model(model_config_from_hf(tiny_hf_config("jamba"))).stages[1:-1]]
    compiled = {layer.kind[0]: layer.runs_compiled(torch.device("cuda")) for layer in layers}
    assert compiled == {"JambaMambaDecoderLayer": False, "JambaAttentionDecoderLayer": True}


def test_a_native_family_through_transformers_equals_its_template(tmp_path):
    """Llama through transformers' modules and through megatrain's template: the same losses, gradient norms and
    weights (fp32; transformers' RMSNorm computes in fp32 whatever the dtype, so float64 would differ by that)."""
    hf = {**COMMON, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    hf_model(hf, 0).save_pretrained(tmp_path / "hf")
    native = generic_trainer(tmp_path / "hf", tmp_path / "native", 0.5, implementation="native")
    generic = generic_trainer(tmp_path / "hf", tmp_path / "generic", 0.5, implementation="transformers")
    assert (native.model_config.implementation, generic.model_config.implementation) == ("native", "transformers")
    assert native.model_config.n_params == generic.model_config.n_params
    assert native.model_config.matmul_params == generic.model_config.matmul_params
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids, labels = random_batch(6, 12, 256, generator)
        ours, theirs = generic.train_step(StepBatch(ids, labels)), native.train_step(StepBatch(ids, labels))
        assert ours.loss == pytest.approx(theirs.loss, rel=1e-5)
        assert ours.grad_norm == pytest.approx(theirs.grad_norm, rel=1e-5)
    ids = torch.randint(0, 256, (2, 12), generator=generator)
    assert rel_err(generic.logits(ids), native.logits(ids)) < 1e-5
    native.close()
    generic.close()


def test_a_load_balancing_loss_is_refused():
    hf = {**tiny_hf_config("phimoe"), "output_router_logits": True, "router_aux_loss_coef": 0.01}
    with pytest.raises(ZooError, match="set output_router_logits: false"):
        model_config_from_hf(hf)


def test_a_native_family_cannot_be_forced_native_when_it_has_no_template():
    with pytest.raises(ZooError, match="unsupported architecture"):
        model_config_from_hf(tiny_hf_config("cohere2"), "native")


def test_a_feature_the_native_template_lacks_trains_through_transformers_unless_native_is_asked():
    """Llama with biases on its MLP: auto takes transformers' modules and says why at the run's start; native
    refuses, naming the feature."""
    hf = {**COMMON, "model_type": "llama", "mlp_bias": True}
    config = model_config_from_hf(hf)
    assert config.implementation == "transformers"
    assert "(its native template: llama with biases on the MLP projections" in generic_notes(config)[0]
    with pytest.raises(TemplateLacks, match="biases on the MLP projections"):
        model_config_from_hf(hf, "native")


STATEFUL = ("falcon_h1", "lfm2", "lfm2_moe", "recurrent_gemma", "jamba", "bamba", "granitemoehybrid")
# forwards that give their layers no mask keeping packed documents apart where positions restart
ATTENDING_ACROSS_DOCUMENTS = ("openai-gpt", "opt")
PACKING = [name for name in FAMILIES if name not in STATEFUL + ATTENDING_ACROSS_DOCUMENTS]


@pytest.mark.parametrize("model_type", PACKING)
def test_packed_documents_train_as_rows_of_their_own(model_type, tmp_path):
    """Two documents packed into a row (positions restarting at the second) give the loss and gradient norm of the
    same documents in rows of their own, in transformers: where transformers keeps a row's documents apart (every
    family whose layers mix tokens by attention alone), the generic path does too."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    reference = hf_model(tiny_hf_config(model_type), seed)
    reference.save_pretrained(tmp_path / "hf")
    trainer = generic_trainer(tmp_path / "hf", tmp_path, 0.0, steps=1)
    generator = torch.Generator().manual_seed(seed)
    ids, labels = random_batch(6, 12, 256, generator)
    labels[:, 4] = -100  # (the first document's last token has no target in the second)
    positions = torch.cat([torch.arange(5), torch.arange(7)]).expand(6, 12)
    metrics = trainer.train_step(StepBatch(ids, labels, position_ids=positions))
    trainer.close()
    loss = 0.0
    for part in (slice(0, 5), slice(5, 12)):
        loss = loss + torch.nn.functional.cross_entropy(
            reference(input_ids=ids[:, part]).logits.flatten(0, 1), labels[:, part].flatten(), reduction="sum"
        )
    loss = loss / (labels != -100).sum()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf"))
    assert metrics.loss == pytest.approx(loss.item(), rel=1e-5)
    assert metrics.grad_norm == pytest.approx(norm.item(), rel=1e-4)


@pytest.mark.parametrize("model_type", sorted(set(FAMILIES) - set(PACKING)))
def test_packing_is_refused_where_layers_would_mix_documents(model_type, tmp_path):
    """Mamba, linear recurrences and short convolutions run through a packed row's documents in transformers, and
    OPT's and GPT-1's attention sees across them: packing is refused, in the config and in a step given position
    ids."""
    hf_model(tiny_hf_config(model_type), 0).save_pretrained(tmp_path / "hf")
    trainer = generic_trainer(tmp_path / "hf", tmp_path, 0.0, steps=1)
    assert not trainer.model_config.packs_documents
    ids, labels = random_batch(2, 12, 256, torch.Generator().manual_seed(0))
    with pytest.raises(GenericError, match="would mix a packed row's documents"):
        trainer.train_step(StepBatch(ids, labels, position_ids=torch.arange(12).expand(2, 12)))
    trainer.close()
    config = trainer.config
    with pytest.raises(ConfigError, match="layers would mix a packed row's documents"):
        Trainer(replace(config, data=replace(config.data, pack=True, dataset="unused")))


def test_a_layer_type_transformers_keeps_a_recurrent_state_for_does_not_pack():
    """MiniMax's lightning attention (layer type "linear_attention", no convolution, no stateful flag) runs through a
    packed row's documents as one in transformers: its config packs no documents; with attention alone it would."""
    extra = dict(num_local_experts=4, num_experts_per_tok=2, block_size=4, output_router_logits=False)
    hf = {**COMMON, "model_type": "minimax", "layer_types": ["linear_attention", "full_attention"], **extra}
    assert not model_config_from_hf(hf).packs_documents
    assert model_config_from_hf({**hf, "layer_types": ["full_attention"] * 2}).packs_documents


# Gemma 3n's text model, tiny: per-layer inputs (the generic path refuses them)
GEMMA3N_TEXT = dict(
    head_dim=16,
    hidden_size_per_layer_input=16,
    vocab_size_per_layer_input=256,
    laurel_rank=8,
    num_kv_shared_layers=0,
    layer_types=["sliding_attention", "full_attention"],
    activation_sparsity_pattern=[0.0, 0.0],
)


def test_a_layer_given_inputs_from_the_tokens_is_refused():
    """Gemma 3n gives each layer an embedding of the tokens of its own (per_layer_input): refused, naming it."""
    with pytest.raises(ZooError, match="Gemma3nTextDecoderLayer 0 is given 'per_layer_input', computed from the tok"):
        model_config_from_hf({**COMMON, "model_type": "gemma3n_text", **GEMMA3N_TEXT})


TINY_MOE = dict(head_dim=16, moe_intermediate_size=32, num_experts_per_tok=2)


@pytest.mark.parametrize(
    "model_type, extra, refusal",
    [
        # each layer given the router states the layer before returned beside its hidden states
        ("zaya", dict(num_experts=4, num_experts_per_tok=1), "ZayaDecoderLayer 1 is given 'prev_router_hidden_states'"),
        # each layer given every earlier layer's output (block_states, growing)
        ("inkling2_text", dict(n_routed_experts=4), r"Inkling2\w+DecoderLayer 1 is given 'block_states'"),
        # a section of layers run several times over (its loops): a layer is no longer one stage
        (
            "dory",
            dict(
                num_hidden_layers=6,
                layer_types=["sliding_attention", "mlp", "full_attention", "mlp", "sliding_attention", "mlp"],
                n_input_layers=2,
                n_recurrent_layers=2,
                n_output_layers=2,
                sliding_window=4,
            ),
            r"calls its decoder layers in the order \[0, 1, 1, 2",
        ),
    ],
)
def test_a_layer_given_an_earlier_layers_output_or_run_twice_is_refused(model_type, extra, refusal):
    """What a layer is given from earlier layers' outputs, beside its hidden states, would need its gradient carried
    between stages; a layer run twice would need its stage twice: refused before training, naming the input."""
    with pytest.raises(ZooError, match=refusal):
        model_config_from_hf({**COMMON, **TINY_MOE, "model_type": model_type, **extra})


def test_an_invalid_config_is_refused_in_transformers_words():
    with pytest.raises(ZooError, match="config.json is no valid zamba2 config for transformers .*layer_types"):
        model_config_from_hf({**COMMON, "model_type": "zamba2", "layer_types": ["mamba"] * 3})


def test_a_run_says_its_path_resumes_exactly_and_exports_its_family(tmp_path, capsys):
    """`megatrain train` on a Cohere 2 directory: says it trains through transformers' modules (and that it leaves
    the config's dropout out), resumes bit-exactly, evaluates, and its final/ loads in transformers."""
    import numpy as np
    import yaml
    from safetensors.torch import load_file

    hf_model({**tiny_hf_config("cohere2"), "attention_dropout": 0.1}, 0).save_pretrained(tmp_path / "hf")
    np.save(tmp_path / "tokens.npy", np.random.default_rng(0).integers(0, 256, 4096).astype(np.int32))

    def config(name: str) -> str:
        path = tmp_path / f"{name}.yaml"
        settings = {"steps": 4, "save_every": 2, "batch_size": 4, "micro_batch_size": 2, "lr": 1e-3}
        path.write_text(
            yaml.safe_dump(
                {
                    "model": {"hf_dir": str(tmp_path / "hf")},
                    "data": {"tokens": str(tmp_path / "tokens.npy"), "seq_len": 16},
                    "train": settings,
                    "precision": {"compute_dtype": "float32"},
                    "device": "cpu",
                    "output_dir": str(tmp_path / name),
                }
            )
        )
        return str(path)

    assert main(["train", "--config", config("full")]) == 0
    err = capsys.readouterr().err
    assert "cohere2 trains through transformers' own modules (megatrain has no template for it)" in err
    assert "config.json's {'attention_dropout': 0.1} are not applied" in err
    step2 = tmp_path / "full/checkpoints/step-00000002"
    assert main(["train", "--config", config("resumed"), "--resume", str(step2)]) == 0
    a, b = (load_file(str(tmp_path / run / "final/model.safetensors")) for run in ("full", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert main(["eval", "--checkpoint", str(tmp_path / "full"), "--batches", "1"]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "full/final", dtype=torch.float32)
    assert type(model).__name__ == "Cohere2ForCausalLM"


def test_layer_counts_follow_a_top_k_given_per_layer():
    """Hunyuan-V1-MoE's top-k as a list, one per layer: each layer's active parameters count its own k experts."""
    hf = tiny_hf_config("hunyuan_v1_moe")
    model = hf_model(hf, 0)
    config = model_config_from_hf(hf)
    for index, k in enumerate(hf["moe_topk"]):
        layer = dict(model.model.layers[index].named_parameters())
        experts = sum(p.numel() for name, p in layer.items() if name.startswith("mlp.experts."))
        others = sum(p.numel() for name, p in layer.items() if not name.startswith("mlp.experts."))
        assert config.layer_counts[index][:2] == (experts + others, experts * k // hf["num_experts"] + others)


def test_a_model_transformers_cannot_build_is_one_line_from_the_command_line(tmp_path):
    """`megatrain train` (a process of its own, as a user runs it) on a config.json transformers accepts but cannot
    build a model of (an activation it does not know): one line naming the model type, what is missing and where,
    a non-zero exit, no traceback, no run directory left."""
    import json
    import subprocess
    import sys

    import numpy as np
    import yaml

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf/config.json").write_text(json.dumps({**tiny_hf_config("cohere2"), "hidden_act": "no_such_act"}))
    np.save(tmp_path / "tokens.npy", np.random.default_rng(0).integers(0, 256, 1024).astype(np.int32))
    settings = {
        "model": {"hf_dir": str(tmp_path / "hf")},
        "data": {"tokens": str(tmp_path / "tokens.npy"), "seq_len": 16},
        "device": "cpu",
        "output_dir": str(tmp_path / "run"),
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(settings))
    process = subprocess.run(
        [sys.executable, "-m", "megatrain", "train", "--config", str(tmp_path / "run.yaml")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    lines = process.stderr.strip().splitlines()
    assert process.returncode not in (0, None) and len(lines) == 1, process.stderr
    assert "cohere2 cannot be built through transformers' own modules: 'no_such_act' missing (KeyError) at " in lines[0]
    assert "modeling_cohere2.py" in lines[0] and "use a family with a native template" in lines[0]
    assert not (tmp_path / "run").exists()
