import math
from unittest import mock

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from kernel_checks import DELTA_CASES, delta_kernels_equal_the_eager_functions
from reference import (
    GemmaRMSNorm,
    RefBlock,
    RefGatedAttentionBlock,
    RefGatedDeltaNetBlock,
    RefGemmaBlock,
    RefMamba2Block,
    RefMoeBlock,
    RefPostNormBlock,
    RMSNorm,
    delta_rule_recurrence,
    flatten_params,
    rel_err,
    ssd_recurrence,
    unflatten_grads,
)

import megatrain_templates.head as head_module
from megatrain_templates import (
    BlockShape,
    DecoderBlock,
    Documents,
    Embedding,
    GatedDeltaNetShape,
    Head,
    Lora,
    Mamba2Shape,
    MoeAttention,
    MoeBlock,
    MoeExperts,
    MoeShape,
    RopeConfig,
    RouterLoad,
    chunked_gated_delta_rule,
    chunked_recurrence,
    chunked_ssd,
    compiling,
    file_tensors,
    rope_inv_freq,
    row_slice_name,
    set_compile,
    split_precision,
    total_numel,
)
from megatrain_templates.chunked_recurrence import _ChunkedRecurrence
from megatrain_templates.moe import CHOSEN_EXPERTS


@pytest.mark.parametrize(
    "qkv_bias,qk_norm,n_kv,rope_scaling,granite,seq",
    [
        (False, False, 2, None, False, 11),
        (False, False, 2, None, False, 32),  # (sequences as long as the model is wide: see the kept products)
        (True, False, 4, None, False, 11),
        (False, True, 1, None, False, 11),
        (
            False,
            False,
            2,
            (
                ("rope_type", "llama3"),
                ("factor", 8.0),
                ("low_freq_factor", 1.0),
                ("high_freq_factor", 4.0),
                ("original_max_position_embeddings", 16),
            ),
            False,
            11,
        ),
        (False, False, 2, None, True, 11),  # Granite's multipliers on the residual branches and the scores
    ],
)
def test_block_matches_module(qkv_bias, qk_norm, n_kv, rope_scaling, granite, seq):
    torch.manual_seed(torch.seed() % 2**31)
    d, heads, head_dim, d_ff, eps = 32, 4, 8, 48, 1e-5
    rope = RopeConfig(head_dim=head_dim, theta=500.0, scaling=rope_scaling)
    multipliers = dict(residual_scale=0.3, softmax_scale=0.2) if granite else {}
    shape = BlockShape(d, heads, n_kv, head_dim, d_ff, eps, qkv_bias, qk_norm, rope, **multipliers)
    block = DecoderBlock(shape)
    ref = RefBlock(d, heads, n_kv, head_dim, d_ff, eps, rope_inv_freq(rope), qkv_bias, qk_norm)
    if granite:
        ref.residual_scale, ref.scale = 0.3, 0.2
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    (specs,) = block.groups
    flat = flatten_params(ref, specs)
    x = torch.randn(3, seq, d, requires_grad=True)
    grad_out = torch.randn(3, seq, d)

    out_ref = ref(x)
    out_ref.backward(grad_out)
    out = block.forward([flat], x.detach())
    assert rel_err(out, out_ref) < 1e-6

    grads = [torch.full((block.numel,), 0.5)]  # gradients must be added, not written
    grad_in = block.backward([flat], x.detach(), grad_out, grads)
    assert rel_err(grad_in, x.grad) < 1e-5
    by_name = unflatten_grads(grads[0] - 0.5, specs)
    for name, p in ref.named_parameters():
        assert rel_err(by_name[name], p.grad) < 1e-5, name

    # a kept layer's slot is overwritten by later layers; its backward reads the weights from where they
    # are streamed in again (another slot, at another offset of its storage)
    other_slot = torch.empty(flat.numel() + 7)[7:]
    other_slot.copy_(flat)

    # kept matmul products stand for the recompute's GEMMs: the backward reads them, not the weights,
    # for those products (so a product from other weights shows in the gradients)
    slot = flat.clone()
    out_products, products = block.forward_keeping_products([slot], x.detach())
    _, with_extras = block.forward_keeping_products([slot], x.detach(), extras=True)
    slot.normal_()
    assert torch.equal(out_products, out)
    # plain causal attention's results stand for the output projection's product where the sequences are at least
    # as long as the model is wide (the recompute runs that GEMM, not the attention); extras keep both
    results, o_product = {"attention out", "attention lse"}, {"o_weight"}
    matrices = {"qkv_weight", "gate_up_weight"}
    assert set(products) == matrices | (results if seq >= d else o_product)
    assert set(with_extras) == matrices | results | o_product
    assert kept_bytes(products) <= block.product_bytes_per_token(4) * 3 * seq  # (the larger of the two)
    assert kept_bytes(products) == block.product_bytes_per_token(4) * 3 * seq or seq < d
    product_and_extra = block.product_bytes_per_token(4) + block.extra_product_bytes_per_token(4)
    assert kept_bytes(with_extras) == product_and_extra * 3 * seq
    for kept in (products, with_extras):
        product_grads = [torch.full((block.numel,), 0.5)]
        grad_in = block.backward([other_slot], x.detach(), grad_out, product_grads, products=kept)
        assert rel_err(grad_in, x.grad) < 1e-5
        assert rel_err(product_grads[0], grads[0]) < 1e-5
    for name in ("gate_up_weight", "attention out"):  # (the kept attention's output stands for its kernel's)
        changed = [torch.zeros(block.numel)]
        kept = {**with_extras, name: with_extras[name] * 1.5}
        block.backward([other_slot], x.detach(), grad_out, changed, products=kept)
        assert rel_err(changed[0], grads[0] - 0.5) > 1e-3, name


def kept_bytes(products: dict) -> int:
    return sum(p.numel() * p.element_size() for p in products.values())


def test_fused_projection_names_are_the_same_bytes():
    """Phi-3's qkv_proj and gate_up_proj are q/k/v and gate/up back to back: one layout, other names."""
    shape = BlockShape(32, 4, 2, 8, 48, rope=RopeConfig(head_dim=8))
    fused = DecoderBlock(BlockShape(32, 4, 2, 8, 48, rope=RopeConfig(head_dim=8), fused_projections=True))
    plain = DecoderBlock(shape)
    names = [p.name for p in fused.groups[0]]
    assert names[:3] == ["self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight"]
    assert fused.numel == plain.numel
    flat, x, grad_out = torch.randn(plain.numel), torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    assert torch.equal(fused.forward([flat], x), plain.forward([flat], x))
    grads = [[torch.zeros(plain.numel)] for _ in range(2)]
    fused.backward([flat], x, grad_out, grads[0])
    plain.backward([flat], x, grad_out, grads[1])
    assert torch.equal(grads[0][0], grads[1][0])


@pytest.mark.parametrize("qk_norm,softcap,window", [(False, 1.5, 4), (True, None, 100)], ids=["gemma2", "gemma3"])
def test_gemma_block_matches_module(qk_norm, softcap, window):
    """Gemma's block: (1 + weight) norms around both halves, a gelu(tanh)-gated MLP, scores scaled by
    query_pre_attn_scalar ** -0.5, soft-capped (Gemma 2) and windowed; per-head q/k norms (Gemma 3)."""
    d, heads, head_dim, d_ff, eps, scalar = 32, 4, 8, 48, 1e-6, 24.0
    rope = RopeConfig(head_dim=head_dim, theta=500.0)
    shape = BlockShape(
        d, heads, 2, head_dim, d_ff, eps, qk_norm=qk_norm, rope=rope, sliding_window=window,
        norm_scale="one_plus_fp32", norm_placement="sandwich", activation="gelu_tanh", softmax_scale=scalar**-0.5,
        attn_softcap=softcap,
    )  # fmt: skip
    ref = RefGemmaBlock(d, heads, 2, head_dim, d_ff, eps, rope_inv_freq(rope), qk_norm, scalar**-0.5, softcap, window)
    check_block_with_normed_outputs(DecoderBlock(shape), ref, d)


def test_olmo2_block_matches_module():
    """OLMo 2's block: norms on the attention's and the MLP's outputs only, the weight applied in fp32."""
    d, heads, head_dim, d_ff, eps = 32, 4, 8, 48, 1e-6
    rope = RopeConfig(head_dim=head_dim, theta=500.0)
    shape = BlockShape(d, heads, 2, head_dim, d_ff, eps, rope=rope, norm_scale="fp32", norm_placement="post")
    ref = RefPostNormBlock(d, heads, 2, head_dim, d_ff, eps, rope_inv_freq(rope))
    check_block_with_normed_outputs(DecoderBlock(shape), ref, d)


def check_block_with_normed_outputs(block, ref, d):
    """Forward, backward and kept products against the module: the norm on the MLP's output makes the backward
    recompute (or reuse) the down projection too."""
    torch.manual_seed(torch.seed() % 2**31)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    (specs,) = block.groups
    assert {spec.name for spec in specs} == {name for name, _ in ref.named_parameters()}
    flat = flatten_params(ref, specs)
    x = torch.randn(3, 11, d, requires_grad=True)
    grad_out = torch.randn(3, 11, d)
    out_ref = ref(x)
    out_ref.backward(grad_out)
    assert rel_err(block.forward([flat], x.detach()), out_ref) < 1e-6
    grads = [torch.full((block.numel,), 0.5)]
    assert rel_err(block.backward([flat], x.detach(), grad_out, grads), x.grad) < 1e-5
    by_name = unflatten_grads(grads[0] - 0.5, specs)
    for name, p in ref.named_parameters():
        assert rel_err(by_name[name], p.grad) < 1e-5, name
    out_products, products = block.forward_keeping_products([flat.clone()], x.detach())
    assert set(products) == {"qkv_weight", "o_weight", "gate_up_weight", "down_weight"}
    # (at most: with sequences as long as the model is wide the attention's results would stand for "o_weight")
    assert kept_bytes(products) <= block.product_bytes_per_token(4) * 3 * 11
    product_grads = [torch.full((block.numel,), 0.5)]
    assert rel_err(block.backward([flat], x.detach(), grad_out, product_grads, products=products), x.grad) < 1e-5
    assert rel_err(product_grads[0], grads[0]) < 1e-5


@pytest.mark.parametrize("shared_d_ff,norm_topk,coef", [(0, True, 0.0), (40, False, 0.3), (0, False, 0.1)])
def test_moe_block_matches_module(shared_d_ff, norm_topk, coef):
    """float64 (both sides compute the rotary angles in fp32, hence 1e-10): the routed
    block (sorted tokens, grouped experts) equals every-expert-on-every-token, and its backward adds
    the load-balancing loss's gradient when the loss is on."""
    torch.manual_seed(torch.seed() % 2**31)
    d, heads, head_dim, eps, n_experts, top_k, d_ff = 32, 4, 8, 1e-5, 6, 2, 24
    rope = RopeConfig(head_dim=head_dim, theta=500.0)
    shape = BlockShape(d, heads, 2, head_dim, 1, eps, rope=rope)
    moe = MoeShape(n_experts, top_k, d_ff, shared_d_ff, norm_topk)
    router_load = RouterLoad(n_experts, top_k, coef)
    block = MoeBlock(shape, moe, router_load)
    ref = RefMoeBlock(d, heads, 2, head_dim, eps, rope_inv_freq(rope), n_experts, top_k, d_ff, shared_d_ff, norm_topk)
    ref = ref.double()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    (specs,) = block.groups
    flat = flatten_params(ref, specs)
    seq = d  # (sequences as long as the model is wide: the attention's results stand for the output projection's)
    x = torch.randn(3, seq, d, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(3, seq, d, dtype=torch.float64)

    out_ref = ref(x)
    ((out_ref * grad_out).sum() + coef * ref.load_balancing_loss()).backward()
    out = block.forward([flat], x.detach())
    assert rel_err(out, out_ref) < 1e-10
    assert router_load.loss().item() == pytest.approx(ref.load_balancing_loss().item(), rel=1e-10)

    grads = [torch.full((block.numel,), 0.5, dtype=torch.float64)]  # gradients must be added, not written
    grad_in = block.backward([flat], x.detach(), grad_out, grads)
    assert rel_err(grad_in, x.grad) < 1e-10
    by_name = unflatten_grads(grads[0] - 0.5, specs)
    for name, p in ref.named_parameters():
        assert rel_err(by_name[name], p.grad) < 1e-10, name
    assert "mlp.experts.5.down_proj.weight" in by_name  # per-expert Hugging Face names

    # kept products stand for the recompute's GEMMs (the experts' gate-up rows too), read from a slot the
    # weights were streamed into again; the routing statistics are the forward's, recorded once a micro-batch
    router_load.reset()
    out_products, products = block.forward_keeping_products([flat.clone()], x.detach(), extras=True)
    assert torch.equal(out_products, out)
    assert router_load.loss().item() == pytest.approx(ref.load_balancing_loss().item(), rel=1e-10)
    shared = {"shared_gate_up", "shared_down", "shared_gate"} if shared_d_ff else set()
    kept = {"qkv_weight", "o_weight", "experts_gate_up", "attention out", "attention lse", CHOSEN_EXPERTS}
    assert set(products) == kept | shared
    assert products["experts_gate_up"].shape == (3 * seq * top_k, 2 * d_ff)
    assert products[CHOSEN_EXPERTS].shape == (3 * seq, top_k)
    product_and_extra = block.product_bytes_per_token(8) + block.extra_product_bytes_per_token(8)
    assert kept_bytes(products) == product_and_extra * 3 * seq
    other_slot = torch.empty(flat.numel() + 3, dtype=torch.float64)[3:]
    other_slot.copy_(flat)
    product_grads = [torch.full((block.numel,), 0.5, dtype=torch.float64)]
    assert rel_err(block.backward([other_slot], x.detach(), grad_out, product_grads, products=products), x.grad) < 1e-10
    assert rel_err(product_grads[0], grads[0]) < 1e-10
    # without extras the attention's results stand for the output projection's product, which the recompute makes
    router_load.reset()
    _, without_extras = block.forward_keeping_products([flat.clone()], x.detach())
    assert set(without_extras) == (kept - {"o_weight"}) | shared
    assert kept_bytes(without_extras) == block.product_bytes_per_token(8) * 3 * seq
    product_grads = [torch.full((block.numel,), 0.5, dtype=torch.float64)]
    grad_in = block.backward([other_slot], x.detach(), grad_out, product_grads, products=without_extras)
    assert rel_err(grad_in, x.grad) < 1e-10
    assert rel_err(product_grads[0], grads[0]) < 1e-10
    # the backward routes as the forward chose (kept), not choosing again
    rerouted = dict(products, **{CHOSEN_EXPERTS: (products[CHOSEN_EXPERTS] + 1) % n_experts})
    changed = [torch.zeros(block.numel, dtype=torch.float64)]
    block.backward([other_slot], x.detach(), grad_out, changed, products=rerouted)
    assert rel_err(changed[0], grads[0] - 0.5) > 1e-3
    products["experts_gate_up"] = products["experts_gate_up"] * 1.5
    changed = [torch.zeros(block.numel, dtype=torch.float64)]
    block.backward([other_slot], x.detach(), grad_out, changed, products=products)
    assert rel_err(changed[0], grads[0] - 0.5) > 1e-3


@pytest.mark.parametrize("naming,shared_d_ff", [("qwen", 40), ("gpt_oss", 0)])
def test_moe_layer_in_parts_equals_the_whole_block(naming, shared_d_ff):
    """float64: attention + shared expert (MoeAttention), then the experts in parts of 2, 1 and 3
    (MoeExperts; for gpt-oss one that no token chooses), passing the [residual, MLP sum] pair, give the whole
    block's output, input gradient and weight gradients (load-balancing loss on); gpt-oss' fused expert
    tensors are stored as row slices, one per part."""
    torch.manual_seed(torch.seed() % 2**31)
    d, n_experts = 32, 6
    shape = BlockShape(d, 4, 2, 8, 1, 1e-5, rope=RopeConfig(head_dim=8, theta=500.0))
    moe = MoeShape(n_experts, 2, 24, shared_d_ff, naming=naming)
    whole = MoeBlock(shape, moe, RouterLoad(n_experts, 2, 0.3))
    load = RouterLoad(n_experts, 2, 0.3)
    (specs,) = whole.groups
    values = {p.name: torch.randn(p.shape, dtype=torch.float64) * 0.3 for p in specs}
    if naming == "gpt_oss":
        values["mlp.router.bias"][2] = -100.0  # no token picks expert 2, the part (2, 3)
    parts = ((0, 2), (2, 3), (3, 6))
    values |= {row_slice_name(n, a, b): v[a:b] for n, v in list(values.items()) for a, b in parts if v.dim() > 0}

    def part_values(params):
        return torch.cat([values[p.name].reshape(-1) for p in params])

    x = torch.randn(3, 11, d, dtype=torch.float64)
    grad_out = torch.randn(3, 11, d, dtype=torch.float64)
    flat = part_values(specs)
    stages = [MoeAttention(shape, moe, load)] + [MoeExperts(shape, moe, a, b) for a, b in parts]
    want = whole.forward([flat], x)
    weights = [[part_values(params) for params in stage.groups] for stage in stages]
    inputs, h = [], x
    for stage, w in zip(stages, weights):
        inputs.append(stage.checkpoint(h) if hasattr(stage, "checkpoint") else h)  # what its backward needs
        h = stage.forward(w, h)
    assert rel_err(h, want) < 1e-12
    assert load.loss().item() == pytest.approx(whole.router_load.loss().item(), rel=1e-12)

    grads = [torch.zeros(whole.numel, dtype=torch.float64)]
    want_grad_in = whole.backward([flat], x, grad_out, grads)
    want_grads = unflatten_grads(grads[0], specs)
    got_grads: dict[str, torch.Tensor] = {}
    g = grad_out
    for stage, w, h in reversed(list(zip(stages, weights, inputs))):
        part_grads = [torch.zeros(t.numel(), dtype=torch.float64) for t in w]
        g = stage.backward(w, h, g, part_grads)
        for params, buffer in zip(stage.groups, part_grads):
            for name, grad in unflatten_grads(buffer, params).items():
                got_grads[name] = got_grads.get(name, 0) + grad
    assert rel_err(g, want_grad_in) < 1e-12
    joined = file_tensors({name: tuple(t.shape) for name, t in got_grads.items()})
    for name, (_, covered) in joined.items():
        got = torch.cat([got_grads[part] for part in covered]) if len(covered) > 1 else got_grads[name]
        assert rel_err(got, want_grads[name]) < 1e-12, name
    assert joined.keys() == want_grads.keys()


def test_gpt_oss_experts_no_token_picks_get_exactly_zero_router_gradient():
    """float32, as transformers' GptOssTopKRouter computes it: the top-k logits weighted by their softmax, so an
    expert no token picked gets a router gradient (weight row and bias) of exactly zero. The top-k probabilities
    renormalised, equal in value, left rounding noise there, which AdamW's eps of 1e-8 turned into updates of up
    to lr."""
    torch.manual_seed(torch.seed() % 2**31)
    d, n_experts, top_k = 32, 16, 2
    shape = BlockShape(d, 4, 2, 8, 1, 1e-5, rope=RopeConfig(head_dim=8, theta=500.0), sinks=True, o_bias=True)
    moe = MoeShape(n_experts, top_k, 24, 0, norm_topk_prob=True, naming="gpt_oss")
    block = MoeBlock(shape, moe)
    (specs,) = block.groups
    flat = torch.cat([torch.randn(p.numel) * 0.3 for p in specs])
    unpicked_rows = 0
    for _ in range(4):  # 6 picks of 16 experts a call
        x = torch.randn(1, 3, d)
        _, routing = block._block_and_router(block._views([flat]), x, None)
        unpicked = sorted(set(range(n_experts)) - set(routing.top_index.flatten().tolist()))
        grads = [torch.zeros(block.numel)]
        block.backward([flat], x, torch.randn(1, 3, d), grads)
        by_name = unflatten_grads(grads[0], specs)
        router, bias = by_name["mlp.router.weight"], by_name["mlp.router.bias"]
        assert torch.count_nonzero(router[unpicked]) == 0 and torch.count_nonzero(bias[unpicked]) == 0
        picked = sorted(set(range(n_experts)) - set(unpicked))
        assert torch.count_nonzero(bias[picked]) == len(picked)  # (the picked ones do learn)
        unpicked_rows += len(unpicked)
    assert unpicked_rows >= 4 * (n_experts - 3 * top_k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sigmoid_routing_chooses_by_the_fp32_correction_bias_in_any_slot(dtype):
    """DeepSeek-V3's correction bias sits near 7 in published checkpoints, with differences far below
    bf16's step there (1/32): kept as hi + lo, a bf16 slot still orders the experts as the fp32 master
    does. With a zero router every score is 0.5, so the bias alone chooses."""
    n_experts, d = 16, 32
    shape = BlockShape(d, 4, 4, 8, 64, rope=RopeConfig(head_dim=8))
    moe = MoeShape(n_experts, 4, 16, 16, True, naming="deepseek", routed_scaling=2.5, scoring="sigmoid")
    block = MoeBlock(shape, moe)
    bias = 7.0 + 0.003 * torch.randperm(n_experts, dtype=torch.float32)  # 0.003 apart: one bf16 value
    hi, lo = split_precision(bias)
    assert torch.equal(hi + lo, bias) and len(set(bias.to(torch.bfloat16).tolist())) < n_experts / 2
    values = {p.name: torch.zeros(p.shape) for p in block.groups[0]}
    values["mlp.gate.e_score_correction_bias{hi}"], values["mlp.gate.e_score_correction_bias{lo}"] = hi, lo
    flat = torch.cat([values[p.name].reshape(-1) for p in block.groups[0]]).to(dtype)  # the slot, cast
    routing = block.route(block._views([flat]), torch.randn(5, d, dtype=dtype))
    top_index, top_weight = routing.top_index, routing.top_weight
    assert (top_index.sort(dim=-1).values == bias.topk(4).indices.sort().values).all()
    assert torch.equal(top_weight, torch.full_like(top_weight, 2.5 / 4))  # unbiased scores, renormalised


def test_llama3_rope_scaling_changes_only_low_frequencies():
    plain = rope_inv_freq(RopeConfig(head_dim=64, theta=500000.0))
    scaled = rope_inv_freq(
        RopeConfig(
            head_dim=64,
            theta=500000.0,
            scaling=(
                ("rope_type", "llama3"),
                ("factor", 8.0),
                ("low_freq_factor", 1.0),
                ("high_freq_factor", 4.0),
                ("original_max_position_embeddings", 8192),
            ),
        )
    )
    assert torch.equal(scaled[:4], plain[:4])  # high frequencies untouched
    assert torch.allclose(scaled[-1], plain[-1] / 8.0)  # lowest frequency divided by the factor


def test_unsupported_rope_scaling_is_refused():
    with pytest.raises(ValueError, match="'dynamic' is not supported"):
        RopeConfig(head_dim=8, scaling=(("rope_type", "dynamic"), ("factor", 4.0)))


def test_embedding_forward_backward():
    vocab, d = 50, 16
    table = torch.randn(vocab, d, requires_grad=True)
    emb = Embedding(vocab, d)
    ids = torch.randint(0, vocab, (4, 9))
    out = emb.forward([table.detach().reshape(-1)], ids)
    assert torch.equal(out, F.embedding(ids, table))
    grad_out = torch.randn(4, 9, d)
    F.embedding(ids, table).backward(grad_out)
    grads = [torch.zeros(vocab * d)]
    emb.backward([table.detach().reshape(-1)], ids, grad_out, grads)
    assert rel_err(grads[0].view(vocab, d), table.grad) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_embedding_forward_backward(dtype):
    """Gemma's embedding: rows times sqrt(d_model) rounded to their dtype, as transformers multiplies."""
    vocab, d = 50, 24
    table = torch.randn(vocab, d, requires_grad=True)
    emb = Embedding(vocab, d, scale=d**0.5)
    ids = torch.randint(0, vocab, (4, 9))
    expected = F.embedding(ids, table.to(dtype)) * torch.tensor(d**0.5, dtype=dtype)
    out = emb.forward([table.detach().to(dtype).reshape(-1)], ids)
    assert torch.equal(out, expected)
    assert torch.equal(emb.forward_rows(table.detach().to(dtype).reshape(-1), ids), expected)
    grad_out = torch.randn(4, 9, d)
    (F.embedding(ids, table) * d**0.5).backward(grad_out)
    grads = [torch.zeros(vocab * d)]
    emb.backward([table.detach().reshape(-1)], ids, grad_out, grads)
    assert rel_err(grads[0].view(vocab, d), table.grad) < 1e-6


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk_rows", [7, 10_000])
@pytest.mark.parametrize("fused", [False, True], ids=["in-place", "fused"])
@pytest.mark.parametrize("family", ["llama", "gemma2", "granite"])
def test_head_loss_and_grads_match_cross_entropy(tied, chunk_rows, fused, family, monkeypatch):
    """Both forms of the logits' gradient: in place (eager, the CPU's) and the one CUDA compiles; Gemma 2's
    final norm (1 + weight) and soft-capped logits; Granite's logits divided by its logits_scaling."""
    if fused:
        monkeypatch.setattr(head_module, "logits_grad", head_module._logits_grad_fused)
    gemma = family == "gemma2"
    vocab, d, eps, softcap = 37, 16, 1e-6, (1.5 if gemma else None)
    divisor = 2.5 if family == "granite" else None
    head = Head(
        vocab,
        d,
        eps,
        tied=tied,
        norm_scale="one_plus_fp32" if gemma else "cast_first",
        logit_softcap=softcap,
        logit_divisor=divisor,
    )
    head.chunk_rows = chunk_rows
    norm = GemmaRMSNorm(d, eps) if gemma else RMSNorm(d, eps)
    with torch.no_grad():
        norm.weight.normal_(1, 0.2)
    matrix = torch.randn(vocab, d, requires_grad=True)
    hidden = torch.randn(3, 8, d, requires_grad=True)
    labels = torch.randint(0, vocab, (3, 8))
    labels[:, -1] = -100
    labels[1, 2] = -100
    n_valid = int((labels != -100).sum())

    logits = norm(hidden) @ matrix.T
    if divisor:
        logits = logits / divisor
    if gemma:
        logits = softcap * torch.tanh(logits / softcap)
        assert logits.abs().max() > 0.9 * softcap  # the cap bites
    ref_loss = F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1), ignore_index=-100)
    ref_loss.backward()

    if tied:
        weights = [matrix.detach().reshape(-1), norm.weight.detach().clone()]
    else:
        weights = [torch.cat([matrix.detach().reshape(-1), norm.weight.detach()])]
    grads = [torch.zeros_like(w) for w in weights]
    loss_sum, grad_hidden = head.loss(weights, hidden.detach(), labels, 1.0 / n_valid, grads)
    assert abs(loss_sum.item() / n_valid - ref_loss.item()) < 1e-5 * abs(ref_loss.item())
    assert rel_err(grad_hidden, hidden.grad) < 1e-5
    flat_grads = torch.cat([g for g in grads])
    assert rel_err(flat_grads[: vocab * d].view(vocab, d), matrix.grad) < 1e-5
    assert rel_err(flat_grads[vocab * d :], norm.weight.grad) < 1e-5
    assert rel_err(head.logits(weights, hidden.detach()), logits.detach()) < 1e-6
    assert head.loss_sum(weights, hidden.detach(), labels).item() == pytest.approx(loss_sum.item(), rel=1e-6)
    # a frozen head (a LoRA run's) has no gradient buffers: the same loss and input gradient
    frozen_sum, frozen_grad_hidden = head.loss(weights, hidden.detach(), labels, 1.0 / n_valid, [None] * len(weights))
    assert torch.equal(frozen_sum, loss_sum) and torch.equal(frozen_grad_hidden, grad_hidden)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk_rows", [5, 10_000])
def test_head_token_logps_and_per_token_scales(tied, chunk_rows):
    """What a step-level objective uses: each target's log-probability (log_softmax's, 0 where ignored), and a
    [batch, seq] loss scale giving the gradient of sum(scale * token cross-entropy)."""
    vocab, d, eps = 29, 12, 1e-6
    head = Head(vocab, d, eps, tied=tied, logit_softcap=2.0)
    head.chunk_rows = chunk_rows
    norm = RMSNorm(d, eps)
    matrix = torch.randn(vocab, d, dtype=torch.float64, requires_grad=True)
    norm = norm.double()
    hidden = torch.randn(2, 7, d, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, vocab, (2, 7))
    labels[0, :3] = -100
    scales = torch.randn(2, 7, dtype=torch.float64)
    logits = 2.0 * torch.tanh(norm(hidden) @ matrix.T / 2.0)
    token_logps = logits.log_softmax(-1).gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    token_logps = token_logps * (labels != -100)
    (-(token_logps * scales).sum()).backward()
    weights = [matrix.detach().reshape(-1), norm.weight.detach().clone()]
    if not tied:
        weights = [torch.cat(weights)]
    grads = [torch.zeros_like(w) for w in weights]
    assert rel_err(head.token_logps(weights, hidden.detach(), labels), token_logps.detach()) < 1e-12
    _, grad_hidden = head.loss(weights, hidden.detach(), labels, scales, grads)
    assert rel_err(grad_hidden, hidden.grad) < 1e-12
    assert rel_err(torch.cat(grads)[: vocab * d].view(vocab, d), matrix.grad) < 1e-12


def test_wrong_buffer_size_is_refused():
    block = DecoderBlock(BlockShape(8, 2, 2, 4, 16))
    with pytest.raises(ValueError, match="layout needs"):
        block.forward([torch.zeros(block.numel + 1)], torch.zeros(1, 2, 8))


def test_no_module_or_graph_survives_a_call():
    block = DecoderBlock(BlockShape(8, 2, 2, 4, 16))
    assert not isinstance(block, nn.Module)
    flat = torch.randn(block.numel)
    out = block.forward([flat], torch.randn(1, 3, 8))
    assert out.grad_fn is None
    grad_in = block.backward([flat], torch.randn(1, 3, 8), torch.randn(1, 3, 8), [torch.zeros(block.numel)])
    assert grad_in.grad_fn is None


# Llama 4's two kinds of layer: chunked with the rotary embedding and q/k RMS norms, and without rotary
# embedding, its queries' temperatures rising with position (both bite at these documents' lengths)
LLAMA4_CHUNKED = dict(rope_interleaved=True, qk_rms_normalized=True, attention_chunk=2, mlp_module="feed_forward")
LLAMA4_NOPE = dict(rotary=False, attn_temperature=(2.0, 0.5), mlp_module="feed_forward")
LLAMA4_MOE = MoeShape(4, 2, 24, shared_d_ff=24, naming="llama4", scoring="sigmoid_of_top_k")


# Qwen3-Next's and Qwen3.5's two kinds of layer: linear attention (chunks of two tokens, so documents start inside
# chunks), and softmax attention whose output a gate scales
LINEAR = dict(
    norm_scale="one_plus_fp32",
    linear_attention=GatedDeltaNetShape(n_key_heads=2, n_value_heads=4, key_head_dim=8, value_head_dim=6, chunk=2),
)
GATED = dict(norm_scale="one_plus_fp32", qk_norm=True, attn_output_gate=True)


@pytest.mark.parametrize(
    "moe, llama4",
    [
        (None, {}),
        (MoeShape(4, 2, 24), {}),
        (None, LLAMA4_CHUNKED),
        (LLAMA4_MOE, LLAMA4_NOPE),
        (None, LINEAR),
        (MoeShape(4, 2, 24, shared_d_ff=16), LINEAR),
        (None, GATED),
    ],
    ids=["dense", "moe", "llama4-chunked", "llama4-moe-nope", "linear-attention", "linear-attention-moe", "gated"],
)
def test_packed_documents_equal_separate_rows(moe, llama4):
    """float64: documents packed into one row (block-diagonal attention, positions restarting: Llama 4's
    chunks and temperatures by each document's positions) give each token the output and the weights the
    gradient of the same documents in rows of their own."""
    torch.manual_seed(torch.seed() % 2**31)
    d, heads, head_dim = 32, 4, 8
    shape = BlockShape(d, heads, 2, head_dim, 40, 1e-5, rope=RopeConfig(head_dim=head_dim, theta=500.0), **llama4)
    block = MoeBlock(shape, moe, RouterLoad(4, 2, 0.0)) if moe else DecoderBlock(shape)
    flat = torch.randn(block.numel, dtype=torch.float64) * 0.3
    lengths = (5, 3, 4)
    docs = [torch.randn(1, n, d, dtype=torch.float64) for n in lengths]
    grad_outs = [torch.randn(1, n, d, dtype=torch.float64) for n in lengths]
    # the row: the three documents, then two padding tokens (a document of their own) with no gradient
    row = torch.cat([*docs, torch.randn(1, 2, d, dtype=torch.float64)], dim=1)
    row_grad = torch.cat([*grad_outs, torch.zeros(1, 2, d, dtype=torch.float64)], dim=1)
    positions = torch.cat([torch.arange(n) for n in (*lengths, 2)]).unsqueeze(0)
    documents = Documents(positions)

    out = block.forward([flat], row, documents)
    packed_grads = [torch.zeros(block.numel, dtype=torch.float64)]
    grad_in = block.backward([flat], row, row_grad, packed_grads, documents)

    separate_grads = [torch.zeros(block.numel, dtype=torch.float64)]
    start = 0
    for doc, grad_out, n in zip(docs, grad_outs, lengths):
        assert rel_err(out[:, start : start + n], block.forward([flat], doc)) < 1e-12
        doc_grad_in = block.backward([flat], doc, grad_out, separate_grads)
        assert rel_err(grad_in[:, start : start + n], doc_grad_in) < 1e-12
        start += n
    assert rel_err(packed_grads[0], separate_grads[0]) < 1e-12


@pytest.mark.parametrize("lora", [None, Lora(4, 8.0, ("q_proj", "o_proj"))], ids=["full", "lora"])
def test_attention_results_stand_for_the_output_projections_product(lora):
    """float64, sequences as long as the model is wide: a forward without extras keeps its attention's results in
    place of the output projection's product (and its adapters' low-rank one), but that product where the
    attention's kernel does not take them (packed documents); the backward from either gives the gradients of the
    backward that recomputes everything."""
    torch.manual_seed(torch.seed() % 2**31)
    d = 16
    block = DecoderBlock(BlockShape(d, 2, 2, 8, 24, 1e-5, rope=RopeConfig(head_dim=8, theta=500.0)), lora=lora)
    weights = [torch.randn(total_numel(group), dtype=torch.float64) * 0.3 for group in block.groups]
    x, grad_out = torch.randn(1, d, d, dtype=torch.float64), torch.randn(1, d, d, dtype=torch.float64)

    def gradients(documents, products=None):
        grads = [None if lora else torch.zeros_like(weights[0]), *(torch.zeros_like(w) for w in weights[1:])]
        return [block.backward(weights, x, grad_out, grads, documents, products), *(g for g in grads if g is not None)]

    for documents in (None, Documents(torch.cat([torch.arange(10), torch.arange(6)]).unsqueeze(0))):
        _, products = block.forward_keeping_products(weights, x, documents)
        o_products = {name for name in products if name.startswith("o_weight")}
        if documents is None:
            assert "attention out" in products and not o_products
        else:
            assert "attention out" not in products
            assert o_products == {"o_weight"} | ({"o_weight.low_rank"} if lora else set())
        assert kept_bytes(products) <= block.product_bytes_per_token(8) * d  # (the larger of the two)
        for ours, want in zip(gradients(documents, products), gradients(documents)):
            assert rel_err(ours, want) < 1e-10


@pytest.mark.parametrize("seq", [24, 26], ids=["whole-chunks", "a-shorter-last-chunk"])
def test_chunks_as_rows_equal_the_masked_attention(seq):
    """float64: Llama 4's chunked attention with the chunks made rows of their own for the fused kernel equals
    the written-out attention under the chunk mask, forward and backward, with grouped queries."""
    from megatrain_templates.attention import chunked_causal_attention, masked_attention

    generator = torch.Generator().manual_seed(torch.seed() % 2**31)
    shapes = [(2, 4, seq, 8), (2, 2, seq, 8), (2, 2, seq, 8)]
    q, k, v = (torch.randn(*shape, dtype=torch.float64, generator=generator) for shape in shapes)
    grad_out = torch.randn(2, 4, seq, 8, dtype=torch.float64, generator=generator)
    results = []
    for attend in (lambda *t: chunked_causal_attention(*t, 6), lambda *t: masked_attention(*t, chunk=6)):
        inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = attend(*inputs)
        out.backward(grad_out)
        results.append([out.detach(), *(t.grad for t in inputs)])
    for ours, reference in zip(*results):
        assert rel_err(ours, reference) < 1e-12


def _eager_kernels(window: int | None):
    """A kernel pair for `kernel_attention` written out (causal, over the last `window` keys if given): the
    forward's output and log-sum-exp, and the backward that flash and cuDNN compute from them."""

    def scores_of(q, k, scale):
        distance = torch.arange(q.shape[2]).unsqueeze(1) - torch.arange(q.shape[2])
        hidden = (distance < 0) | (distance >= (window or q.shape[2]))
        return ((q @ k.transpose(-1, -2)) * scale).masked_fill(hidden, -math.inf)

    def expanded(q, k, v):
        return [t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v)]

    def forward(q, k, v, scale):
        k, v = expanded(q, k, v)
        scores = scores_of(q, k, scale)
        lse = scores.logsumexp(-1)
        return (scores - lse.unsqueeze(-1)).exp() @ v, lse

    def backward(grad_out, q, k, v, out, lse, scale):
        kv_heads = k.shape[1]
        k, v = expanded(q, k, v)
        probs = (scores_of(q, k, scale) - lse.unsqueeze(-1)).exp()
        grad_scores = probs * (grad_out @ v.transpose(-1, -2) - (grad_out * out).sum(-1, keepdim=True))
        dq, dk, dv = (
            grad_scores @ k * scale,
            grad_scores.transpose(-1, -2) @ q * scale,
            probs.transpose(-1, -2) @ grad_out,
        )
        return dq, *(g.unflatten(1, (kv_heads, -1)).sum(2) for g in (dk, dv))

    return forward, backward


@pytest.mark.parametrize("window,with_sinks", [(None, True), (5, False), (5, True)], ids=["sinks", "window", "both"])
def test_kernel_attention_folds_the_sinks_in_exactly(window, with_sinks):
    """float64: attention by a kernel pair (the written-out one here; flash's window and cuDNN's causal kernel on
    the GPU) with the sinks folded in through its log-sum-exp, forward and backward, equals the written-out
    masked attention: output and the gradients by q, k, v and the sinks, grouped keys and values."""
    from megatrain_templates.attention import masked_attention
    from megatrain_templates.kernel_attention import kernel_attention

    generator = torch.Generator().manual_seed(torch.seed() % 2**31)
    shapes = [(2, 4, 13, 8), (2, 2, 13, 8), (2, 2, 13, 8), (4,)]
    q, k, v, sinks = (torch.randn(*shape, dtype=torch.float64, generator=generator) for shape in shapes)
    sinks = sinks if with_sinks else None
    grad_out = torch.randn(2, 4, 13, 8, dtype=torch.float64, generator=generator)
    results = []
    for attend in (
        lambda q, k, v, s: kernel_attention(q, k, v, s, 0.3, _eager_kernels(window)),
        lambda q, k, v, s: masked_attention(q, k, v, s, window, None, 0.3),
    ):
        leaves = [None if t is None else t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
        out = attend(*leaves)
        out.backward(grad_out)
        results.append([out.detach(), *(t.grad for t in leaves if t is not None)])
    for ours, reference in zip(*results):
        assert rel_err(ours, reference) < 1e-12


@pytest.mark.gpu
@pytest.mark.parametrize(
    "heads,kv_heads,seq,head_dim,window,with_sinks",
    [(8, 4, 2048, 256, 512, False), (4, 1, 1000, 256, 129, False), (16, 2, 1000, 64, None, True)],
    ids=["gemma3-4b-window", "a-window-across-odd-tiles", "gpt-oss-sinks"],
)
def test_gpu_kernel_attention_equals_the_written_out_attention(heads, kv_heads, seq, head_dim, window, with_sinks):
    """bf16 on CUDA: a window alone (Gemma 3's heads of 256) runs flash attention's sliding window and sinks alone
    (gpt-oss' full layers) cuDNN's causal attention with the sinks folded in. Output and gradients (by q, k, v and
    the sinks) against the written-out attention in float64 on the same inputs (grouped keys, rows that are not
    multiples of the kernels' tiles), and no farther from it than FlexAttention, which they replace there."""
    from megatrain_templates.attention import _flex_masked, masked_attention
    from megatrain_templates.kernel_attention import cudnn_fits, flash_window_wins

    torch.manual_seed(torch.seed() % 2**31)
    q = torch.randn(2, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16)
    assert cudnn_fits(q) if with_sinks else flash_window_wins(q)
    k, v = (torch.randn(2, kv_heads, seq, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    sinks = torch.randn(heads, device="cuda", dtype=torch.bfloat16) if with_sinks else None
    grad_out = torch.randn_like(q)
    scale = head_dim**-0.5

    def run(attend, dtype, device):
        leaves = [
            None if t is None else t.detach().to(device, dtype, copy=True).requires_grad_(True)
            for t in (q, k, v, sinks)
        ]
        out = attend(*leaves)
        out.backward(grad_out.to(device, dtype))
        return [out.detach(), *(t.grad for t in leaves if t is not None)]

    reference = run(lambda q, k, v, s: masked_attention(q, k, v, s, window, None, scale), torch.float64, "cpu")
    ours = run(lambda q, k, v, s: masked_attention(q, k, v, s, window, None, scale), torch.bfloat16, "cuda")
    flex = run(lambda q, k, v, s: _flex_masked(q, k, v, s, window, None, scale, None, None), torch.bfloat16, "cuda")
    for mine, theirs, truth in zip(ours, flex, reference):
        error = rel_err(mine.cpu(), truth)
        assert error < 1e-2
        assert error <= 1.5 * rel_err(theirs.cpu(), truth) + 1e-4


def check_chunked_equals_recurrence(chunked, recurrence, inputs, lengths, chunk, grad_out):
    """float64: `chunked(*inputs, doc_ids, chunk)` over rows packing documents of `lengths` tokens equals
    `recurrence(inputs, start, stop)` (one document's tokens, from a zero state) document by document: the
    output and every input's gradient."""
    positions = torch.cat([torch.arange(n) for n in lengths]).expand(2, -1)
    documents = Documents(positions) if len(lengths) > 1 else None
    ends = torch.tensor(lengths).cumsum(0).tolist()
    results = []
    for packed in (True, False):
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        if packed:
            out = chunked(*leaves, None if documents is None else documents.doc_ids, chunk)
        else:
            out = torch.cat([recurrence(leaves, end - n, end) for n, end in zip(lengths, ends)], dim=1)
        out.backward(grad_out)
        results.append([out.detach(), *(t.grad for t in leaves)])
    for ours, reference in zip(*results):
        assert rel_err(ours, reference) < 1e-12


@pytest.mark.parametrize("chunk,lengths", [(4, (11,)), (64, (11,)), (5, (4, 1, 9, 6)), (3, (3, 3, 1))])
def test_chunked_gated_delta_rule_equals_the_recurrence(chunk, lengths):
    """float64: the chunked form (a chunk longer than the row, a shorter last chunk, documents starting inside a
    chunk, on its first token and one token long) equals the delta rule token by token, each document from a zero
    state, with grouped value heads; and so do the gradients of all five inputs."""
    generator = torch.Generator().manual_seed(torch.seed() % 2**31)
    seq, n_k, n_v = sum(lengths), 2, 4

    def randn(*shape):
        return torch.randn(2, seq, *shape, dtype=torch.float64, generator=generator)

    q, k, v = randn(n_k, 8), randn(n_k, 8), randn(n_v, 6)
    log_decay = -torch.rand(2, seq, n_v, dtype=torch.float64, generator=generator) * 2
    beta = torch.rand(2, seq, n_v, dtype=torch.float64, generator=generator)

    def recurrence(inputs, start, stop):
        q, k, *rest = (t[:, start:stop] for t in inputs)
        return delta_rule_recurrence(q.repeat_interleave(n_v // n_k, 2), k.repeat_interleave(n_v // n_k, 2), *rest)

    inputs = [q, k, v, log_decay, beta]
    check_chunked_equals_recurrence(chunked_gated_delta_rule, recurrence, inputs, lengths, chunk, randn(n_v, 6))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rule", ["gated-delta", "ssd"])
def test_gpu_chunked_recurrence_equals_float64(rule, dtype, bound):
    """On CUDA the state pass runs as Triton kernels (exact fp32 matmuls for fp32 inputs, TF32 for bf16 ones, as
    the chunk's GEMMs then are): output and every input's gradient against the float64 CPU form on the same
    inputs, over packed documents (one starting inside a chunk), 64-token chunks, a shorter last chunk, and
    Qwen3.5's head widths."""
    generator = torch.Generator().manual_seed(torch.seed() % 2**31)
    lengths, heads, d_k, d_v = (200, 37, 300), 4, 128, 128
    seq = sum(lengths)
    documents = Documents(torch.cat([torch.arange(n) for n in lengths]).expand(2, -1))

    def randn(*shape, scale=1.0):
        return torch.randn(2, seq, *shape, dtype=torch.float64, generator=generator) * scale

    def rand(*shape):
        return torch.rand(2, seq, *shape, dtype=torch.float64, generator=generator)

    if rule == "gated-delta":
        function = chunked_gated_delta_rule
        inputs = [randn(2, d_k), randn(2, d_k), randn(heads, d_v), -rand(heads) * 0.5, rand(heads)]
    else:
        function = chunked_ssd
        a = -torch.rand(heads, dtype=torch.float64, generator=generator) - 0.2
        inputs = [randn(heads, d_v), rand(heads) * 0.2 + 0.01, a, randn(2, d_k, scale=0.1), randn(2, d_k, scale=0.1)]
    inputs = [t.to(dtype) if t.dim() == 4 else t.float() for t in inputs]  # the model's dtype, the decays fp32
    grad_out = randn(heads, d_v)
    results = []
    for device, cast in (("cpu", torch.float64), ("cuda", None)):
        leaves = [(t if cast is None else t.to(cast)).to(device).requires_grad_(True) for t in inputs]
        out = function(*leaves, documents.doc_ids.to(device), 64)
        out.backward(grad_out.to(device, out.dtype))
        results.append([out.detach(), *(t.grad for t in leaves)])
    for ours, reference in zip(results[1], results[0]):
        assert rel_err(ours.cpu().double(), reference) < bound


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(DELTA_CASES))
def test_gpu_chunk_kernels_equal_the_eager_functions(case):
    """The chunked rule's Triton kernels, compiled (the state pass both ways; the work before it, forward and
    backward, with its UT inverse; the output; the gradients by q, k, v, log decay and beta) against the eager
    functions they stand for, in fp32 with exact matmuls, on the same states: documents starting inside a chunk,
    value widths off the kernels' blocks, keys narrower than a tile, with and without the delta's beta, at the
    engine's launches and the smallest key steps and value blocks (`kernel_checks`, which CI runs under Triton's
    CPU interpreter)."""
    torch.manual_seed(torch.seed() % 2**31)
    delta_kernels_equal_the_eager_functions(*DELTA_CASES[case], device="cuda")


@pytest.mark.gpu
def test_gpu_kept_recurrence_gives_the_recomputed_gradients():
    """bf16 on CUDA, the recurrence on its Triton kernels: a Qwen3.5-shaped linear-attention layer's backward from
    kept products (the recurrence's results among them) gives the gradients its backward recomputing everything
    gives."""
    torch.manual_seed(torch.seed() % 2**31)
    mixer = GatedDeltaNetShape(n_key_heads=2, n_value_heads=4, key_head_dim=128, value_head_dim=128)
    block = DecoderBlock(BlockShape(256, 4, 2, 64, 512, 1e-6, norm_scale="one_plus_fp32", linear_attention=mixer))
    flat = (torch.randn(block.numel, device="cuda") * 0.05).bfloat16()
    x = torch.randn(2, 200, 256, device="cuda", dtype=torch.bfloat16)
    grad_out = torch.randn_like(x)
    _, products = block.forward_keeping_products([flat], x, extras=True)
    assert "recurrence states" in products
    results = []
    for kept in (None, products):
        grads = [torch.zeros(block.numel, device="cuda")]
        results.append([block.backward([flat], x, grad_out, grads, products=kept), grads[0]])
    for ours, recomputed in zip(*results):
        assert rel_err(ours.double(), recomputed.double()) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("moe", [False, True])
def test_gpu_kept_attention_gives_the_recomputed_gradients(moe):
    """bf16 on CUDA, attention by cuDNN: a block's backward from kept products (attention's output and log-sum-exp
    among them, `KeptAttention`) gives the gradients its backward recomputing everything gives, dense and MoE."""
    torch.manual_seed(torch.seed() % 2**31)
    shape = BlockShape(256, 4, 2, 64, 512, 1e-6, qkv_bias=True, rope=RopeConfig(head_dim=64))
    block = MoeBlock(shape, MoeShape(n_experts=4, top_k=2, d_ff=128)) if moe else DecoderBlock(shape)
    flat = (torch.randn(block.numel, device="cuda") * 0.05).bfloat16()
    x = torch.randn(2, 256, 256, device="cuda", dtype=torch.bfloat16)
    grad_out = torch.randn_like(x)
    _, products = block.forward_keeping_products([flat], x, extras=True)
    assert products["attention lse"].shape == (2, 4, 256)
    # sequences as long as the model is wide: without extras the results stand for the output projection's product
    _, without_extras = block.forward_keeping_products([flat], x)
    assert "attention out" in without_extras and "o_weight" not in without_extras
    results = []
    wrong = {**products, "attention out": products["attention out"] * 1.5}
    for kept in (None, products, without_extras, wrong):
        grads = [torch.zeros(block.numel, device="cuda")]
        results.append([block.backward([flat], x, grad_out, grads, products=kept), grads[0]])
    (recomputed, ours, ours_without_extras, wrong) = ([t.double() for t in pair] for pair in results)
    for i in range(2):
        assert rel_err(ours[i], recomputed[i]) < 1e-2
        assert rel_err(ours_without_extras[i], recomputed[i]) < 1e-2
    assert rel_err(wrong[1], recomputed[1]) > 0.1  # the kept output is what the backward reads


@pytest.mark.parametrize("chunk,lengths", [(4, (11,)), (64, (11,)), (5, (4, 1, 9, 6))])
def test_chunked_ssd_equals_the_recurrence(chunk, lengths):
    """float64: Mamba-2's chunked recurrence (groups of heads sharing B and C, documents restarting the state)
    equals it token by token, each document from a zero state; and so do the gradients of all five inputs."""
    generator = torch.Generator().manual_seed(torch.seed() % 2**31)
    seq, groups, heads = sum(lengths), 2, 4

    def randn(*shape):
        return torch.randn(2, seq, *shape, dtype=torch.float64, generator=generator)

    x, b, c = randn(heads, 6), randn(groups, 8), randn(groups, 8)
    dt = torch.rand(2, seq, heads, dtype=torch.float64, generator=generator) + 0.1
    a = -torch.rand(heads, dtype=torch.float64, generator=generator) * 2

    def recurrence(inputs, start, stop):
        x, dt, a, b, c = inputs
        b, c = (t[:, start:stop].repeat_interleave(heads // groups, 2) for t in (b, c))
        return ssd_recurrence(x[:, start:stop], dt[:, start:stop], a, b, c)

    check_chunked_equals_recurrence(chunked_ssd, recurrence, [x, dt, a, b, c], lengths, chunk, randn(heads, 6))


def test_mamba2_block_matches_module():
    """float64: Granite 4.0-H's Mamba-2 block (the chunked recurrence, the convolution with its bias as shifted
    taps, the grouped gated norm, residual multipliers) against the textbook module: output, input and weight
    gradients; kept products stand for the projections' GEMMs."""
    torch.manual_seed(torch.seed() % 2**31)
    mamba = Mamba2Shape(n_groups=2, n_heads=4, state_dim=8, head_dim=6, conv_kernel=4, chunk=4)
    block = DecoderBlock(BlockShape(32, 4, 2, 8, 40, 1e-6, linear_attention=mamba, residual_scale=0.4))
    ref = RefMamba2Block(32, 2, 4, 8, 6, 4, 40, 1e-6, 0.4).double()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
        ref.mamba.A_log.uniform_(-1, 1)
    flat, x, grad_out, grads = check_float64_block_against_module(block, ref, 1e-12)
    check_kept_products_of_linear_attention(block, flat, x, grad_out, grads, ut_inverse=False)


LINEAR_SHAPE = dict(n_key_heads=2, n_value_heads=4, key_head_dim=8, value_head_dim=6, conv_kernel=4, chunk=4)


def linear_attention_block(grouped: bool = False) -> DecoderBlock:
    """Qwen3.5's (grouped: Qwen3-Next's) linear-attention layer at a small shape, chunks of 4 tokens."""
    linear = GatedDeltaNetShape(**LINEAR_SHAPE, grouped_projections=grouped)
    return DecoderBlock(BlockShape(32, 4, 2, 8, 40, 1e-6, norm_scale="one_plus_fp32", linear_attention=linear))


def random_linear_reference() -> RefGatedDeltaNetBlock:
    ref = RefGatedDeltaNetBlock(32, 2, 4, 8, 6, 4, 40, 1e-6).double()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    return ref


def check_float64_block_against_module(block: DecoderBlock, ref: nn.Module, out_tolerance: float):
    """float64: `block` on `ref`'s weights against `ref`: the output, the input's gradient and the weights' (added
    into the buffer, not written). Returns (weights, input, output gradient, the weights' gradient buffer)."""
    (specs,) = block.groups
    assert {spec.name for spec in specs} == {name for name, _ in ref.named_parameters()}
    flat = flatten_params(ref, specs)
    x = torch.randn(3, 11, 32, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(3, 11, 32, dtype=torch.float64)
    out_ref = ref(x)
    out_ref.backward(grad_out)
    assert rel_err(block.forward([flat], x.detach()), out_ref) < out_tolerance
    grads = [torch.full((block.numel,), 0.5, dtype=torch.float64)]
    assert rel_err(block.backward([flat], x.detach(), grad_out, grads), x.grad) < 1e-10
    by_name = unflatten_grads(grads[0] - 0.5, specs)
    for name, p in ref.named_parameters():
        assert rel_err(by_name[name], p.grad) < 1e-10, name
    return flat, x, grad_out, grads[0]


def test_linear_attention_block_matches_module():
    """float64: the linear-attention block (Gated DeltaNet on the chunked delta rule, the short convolution as
    shifted taps) against the textbook module (F.conv1d, the delta rule token by token): output, input and
    weight gradients, added into the buffer; kept products stand for the projections' GEMMs."""
    torch.manual_seed(torch.seed() % 2**31)
    block = linear_attention_block()
    flat, x, grad_out, grads = check_float64_block_against_module(block, random_linear_reference(), 1e-12)
    check_kept_products_of_linear_attention(block, flat, x, grad_out, grads, ut_inverse=True)


def check_kept_products_of_linear_attention(block, flat, x, grad_out, grads, ut_inverse: bool):
    """A linear-attention block's kept products (float64): the projections' and, with extras, the recurrence's
    results (`KeptRecurrence`), `product_bytes_per_token` and `extra_product_bytes_per_token` of them a token of
    whole chunks; given back, the backward
    computes the same gradients without running the recurrence's forward again, and from what it is given (a
    kept state from elsewhere shows in the gradients)."""
    runs = []
    results = _ChunkedRecurrence._results
    with mock.patch.object(_ChunkedRecurrence, "_results", lambda *a: runs.append(1) or results(*a)):
        _, products = block.forward_keeping_products([flat], x.detach(), extras=True)
        assert len(runs) == 1
        recurrence = {"recurrence out", "recurrence states", "recurrence delta"}
        assert set(products) == {"linear_in", "linear_out", "gate_up_weight"} | recurrence | (
            {"recurrence ut_inverse"} if ut_inverse else set()
        )
        product_grads = [torch.full((block.numel,), 0.5, dtype=torch.float64)]
        grad_in = block.backward([flat], x.detach(), grad_out, product_grads, products=products)
        assert len(runs) == 1
    assert rel_err(grad_in, x.grad) < 1e-10
    assert rel_err(product_grads[0], grads) < 1e-12
    products["recurrence states"] = products["recurrence states"] * 1.5
    changed = [torch.full((block.numel,), 0.5, dtype=torch.float64)]
    block.backward([flat], x.detach(), grad_out, changed, products=products)
    assert rel_err(changed[0], grads) > 1e-3
    whole_chunks = torch.randn(2, 3 * block.shape.linear_attention.chunk, x.shape[-1], dtype=torch.float64)
    for extras, extra_bytes in ((False, 0), (True, block.extra_product_bytes_per_token(8))):
        _, products = block.forward_keeping_products([flat], whole_chunks, extras=extras)
        kept_bytes = sum(p.numel() for p in products.values()) * 8
        assert kept_bytes == (block.product_bytes_per_token(8) + extra_bytes) * whole_chunks[..., 0].numel()


def grouped_projections(flat_split: torch.Tensor, split: DecoderBlock, grouped: DecoderBlock) -> torch.Tensor:
    """The split layout's buffer rewritten in Qwen3-Next's: in_proj_qkvz and in_proj_ba rows grouped by key
    head (its q, its k, its value heads' v, their z; its value heads' b, their a)."""
    views = {p.name: v for p, v in zip(split.groups[0], flat_split.split([p.numel for p in split.groups[0]]))}
    d, n_k, d_k, per, d_v = 32, 2, 8, 2, 6
    qkv = views["linear_attn.in_proj_qkv.weight"].view(-1, d)
    q, k, v = qkv.split([n_k * d_k, n_k * d_k, n_k * per * d_v])
    z = views["linear_attn.in_proj_z.weight"].view(-1, d)
    b, a = views["linear_attn.in_proj_b.weight"].view(-1, d), views["linear_attn.in_proj_a.weight"].view(-1, d)
    qkvz = torch.cat([torch.cat([t.view(n_k, -1, d)[i] for t in (q, k, v, z)]) for i in range(n_k)])
    ba = torch.cat([torch.cat([t.view(n_k, -1, d)[i] for t in (b, a)]) for i in range(n_k)])
    views["linear_attn.in_proj_qkvz.weight"], views["linear_attn.in_proj_ba.weight"] = qkvz, ba
    return torch.cat([views[p.name].reshape(-1) for p in grouped.groups[0]])


def test_grouped_projections_are_the_split_ones_reordered():
    """Qwen3-Next's in_proj_qkvz / in_proj_ba layout computes what Qwen3.5's four projections do with the same
    rows, forward and backward (its gradients are the split ones, reordered the same way)."""
    split, grouped = linear_attention_block(), linear_attention_block(grouped=True)
    assert split.numel == grouped.numel
    flat = flatten_params(random_linear_reference(), split.groups[0])
    flat_grouped = grouped_projections(flat, split, grouped)
    x, grad_out = torch.randn(2, 9, 32, dtype=torch.float64), torch.randn(2, 9, 32, dtype=torch.float64)
    assert rel_err(grouped.forward([flat_grouped], x), split.forward([flat], x)) < 1e-14
    grads = [[torch.zeros(split.numel, dtype=torch.float64)] for _ in range(2)]
    grad_split = split.backward([flat], x, grad_out, grads[0])
    grad_grouped = grouped.backward([flat_grouped], x, grad_out, grads[1])
    assert rel_err(grad_grouped, grad_split) < 1e-13
    assert rel_err(grads[1][0], grouped_projections(grads[0][0], split, grouped)) < 1e-13


def test_gated_attention_block_matches_module():
    """float64: Qwen3-Next's and Qwen3.5's softmax-attention layer (the gate as each query head's second half of
    q_proj, (1 + weight) norms on the input, the MLP's input and per-head q/k) against the textbook module."""
    torch.manual_seed(torch.seed() % 2**31)
    rope = RopeConfig(head_dim=8, theta=500.0)
    shape = BlockShape(
        32, 4, 2, 8, 40, 1e-6, qk_norm=True, rope=rope, norm_scale="one_plus_fp32", attn_output_gate=True
    )
    ref = RefGatedAttentionBlock(32, 4, 2, 8, 40, 1e-6, rope_inv_freq(rope)).double()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    check_float64_block_against_module(DecoderBlock(shape), ref, 1e-10)  # (rotary angles in fp32 on both sides)


@pytest.mark.parametrize("qk_norm_scope", [None, "head", "full"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("traced", [False, True])
def test_the_fused_heads_and_residual_norm_equal_the_operations_they_stand_for(
    monkeypatch, qk_norm_scope, packed, traced
):
    """`rotary_heads` (q, k, v of one projection, normed and rotated) and `add_rms_norm` (a residual add and the norm
    that reads its sum), as a Qwen2-, Qwen3- or OLMoE-shaped block runs them, give the block the output and gradients
    of the one-operation-at-a-time path they stand for (float64): eagerly, and `traced` as CUDA compiles them (by
    AOTAutograd, which differentiates the traced graph)."""
    import megatrain_templates.decoder as decoder_module
    from megatrain_templates import ops

    if traced:
        for name in ("rotary_heads", "add_rms_norm"):
            monkeypatch.setattr(decoder_module, name, torch.compile(getattr(ops, "_" + name), backend="aot_eager"))
    torch.manual_seed(0)
    shape = BlockShape(
        d_model=48, n_heads=4, n_kv_heads=2, head_dim=12, d_ff=40, qkv_bias=True,
        qk_norm=qk_norm_scope is not None, qk_norm_scope=qk_norm_scope or "head",
    )  # fmt: skip
    assert shape.rotates_whole_heads and shape.norms_its_residual_adds
    block = DecoderBlock(shape)
    weights = [torch.randn(block.numel, dtype=torch.float64) * 0.3]
    x, grad_out = torch.randn(2, 2, 10, 48, dtype=torch.float64).unbind(0)
    documents = Documents(torch.tensor([list(range(6)) + list(range(4)), list(range(10))])) if packed else None

    def step(fused: bool):
        for name in ("rotates_whole_heads", "norms_its_residual_adds"):
            monkeypatch.setattr(BlockShape, name, property(lambda self: fused))
        grads = [torch.zeros(block.numel, dtype=torch.float64)]
        out = block.forward(weights, x, documents)
        return out, block.backward(weights, x, grad_out, grads, documents), grads[0]

    for fused, one_at_a_time in zip(step(True), step(False)):
        assert torch.allclose(fused, one_at_a_time, rtol=1e-10, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("qk_norm_scope", [None, "head", "full"])
def test_gpu_fused_elementwise_kernels_follow_float64(qk_norm_scope):
    """A Qwen2-, Qwen3- or OLMoE-shaped block on the GPU in bf16, through its fused kernels (`rotary_heads` and
    `add_rms_norm` compiled, the SwiGLU kernels), follows the same block in float64 within bf16's rounding, output
    and gradients; at 1000 tokens (the kernels' blocks cut inside a row)."""
    torch.manual_seed(0)
    shape = BlockShape(
        d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=1100,
        qk_norm=qk_norm_scope is not None, qk_norm_scope=qk_norm_scope or "head",
    )  # fmt: skip
    block = DecoderBlock(shape)
    weights = torch.randn(block.numel, device="cuda", dtype=torch.float64) * 0.05
    x, grad_out = torch.randn(2, 2, 500, 256, device="cuda", dtype=torch.float64).unbind(0)
    results = []
    for dtype in (torch.bfloat16, torch.float64):
        grads = [torch.zeros(block.numel, device="cuda", dtype=torch.float32 if dtype == torch.bfloat16 else dtype)]
        ins = [weights.to(dtype)], x.to(dtype)
        out = block.forward(*ins)
        results.append((out, block.backward(*ins, grad_out.to(dtype), grads), grads[0]))
    for name, ours, want in zip(("output", "input gradient", "weight gradient"), *results):
        assert rel_err(ours, want) < 1e-2, f"{name}: relative error {rel_err(ours, want):.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("weighted", [False, True])
def test_gpu_swiglu_kernels_follow_float64(weighted):
    """`ops.swiglu` on the GPU in bf16 (the SwiGLU kernels), weighted by a MoE row's routing weight or not, follows
    float64 within bf16's rounding: output and the gradients of gate_up and the weight (summed over a row's two
    blocks)."""
    from megatrain_templates.ops import swiglu

    torch.manual_seed(0)
    gate_up = torch.randn(1000, 2 * 1100, device="cuda", dtype=torch.float64) * 3
    weight = torch.rand(1000, 1, device="cuda", dtype=torch.float64) if weighted else None
    grad = torch.randn(1000, 1100, device="cuda", dtype=torch.float64)
    results = []
    for dtype in (torch.bfloat16, torch.float64):
        inputs = [t.to(dtype).requires_grad_(True) for t in (gate_up, weight) if t is not None]
        out = swiglu(*inputs)
        results.append((out, *torch.autograd.grad(out, inputs, grad.to(dtype))))
    for name, ours, want in zip(("output", "gate_up's gradient", "weight's gradient"), *results):
        assert rel_err(ours, want) < 1e-2, f"{name}: relative error {rel_err(ours, want):.2e}"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_swiglu_backward_over_its_input_gives_what_the_plain_one_gives(device):
    """`ops.swiglu_output_and_backward(..., overwrite=True)` (the dense and MoE backwards') gives what the plain call
    gives, gate_up's gradient written over gate_up (on CUDA by the one-pass kernel), and leaves its version alone:
    gate_up `ops.linear`'s kept product (a view made in its custom Function), autograd still goes back through it."""
    from megatrain_templates.layout import BoundWeight
    from megatrain_templates.ops import linear, swiglu_output_and_backward

    torch.manual_seed(torch.seed() % 2**31)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = torch.randn(48, 32, device=device, dtype=dtype, requires_grad=True)
    projection = torch.randn(2 * 80, 32, device=device, dtype=dtype)
    kept = x.detach() @ projection.T  # a kept product, standing for the projection's GEMM
    into = torch.zeros(2 * 80, 32, device=device)
    gate_up = linear(x, BoundWeight(projection, into, product=kept))  # (a view of `kept`, made in a custom Function)
    weight, grad = torch.rand(48, 1, device=device, dtype=dtype), torch.randn(48, 80, device=device, dtype=dtype)
    want = swiglu_output_and_backward(kept.clone(), grad, weight)
    got = swiglu_output_and_backward(gate_up.detach(), grad, weight, overwrite=True)
    assert got[1].data_ptr() == kept.data_ptr()
    for name, ours, theirs in zip(("output", "gate_up's gradient", "weight's gradient"), got, want):
        assert torch.equal(ours, theirs), f"{name} differs over gate_up"
    (grad_x,) = torch.autograd.grad(gate_up, x, got[1])
    assert torch.equal(grad_x, want[1] @ projection)


def test_compilation_off_runs_the_functions_as_written(monkeypatch):
    """`set_compile(False)` (engine.compile: false): the fast path runs its functions eagerly, never compiling one;
    on again, it compiles each once."""
    compiled = []
    monkeypatch.setattr(chunked_recurrence, "compile_once", lambda fn: compiled.append(fn) or fn)
    monkeypatch.setattr(chunked_recurrence, "_COMPILED", {})

    def add_one(x):
        return x + 1

    try:
        set_compile(False)
        assert not compiling() and chunked_recurrence._run(add_one, True, 1) == 2 and compiled == []
    finally:
        set_compile(True)
    assert compiling() and chunked_recurrence._run(add_one, True, 1) == 2 and compiled == [add_one]


def test_a_compiled_function_takes_its_floats_as_constants_never_as_host_tensor_inputs():
    """A second value of a float argument (Qwen3.5's key scale after its query scale) compiles a graph with that
    value in it, not one taking a 0-dim host tensor, for which Inductor would build a host kernel beside the GPU's."""
    from megatrain_templates.ops import compile_once

    graph_inputs = []

    def recording_backend(graph, inputs):
        graph_inputs.append(inputs)
        return graph.forward

    def scaled_unit_rows(x, scale):
        return x * torch.rsqrt((x * x).sum(-1, keepdim=True)) * scale

    compiled, x = compile_once(scaled_unit_rows, backend=recording_backend), torch.randn(3, 4)
    for scale in (0.125, 1.0, 0.5):
        assert torch.allclose(compiled(x, scale), scaled_unit_rows(x, scale))
    assert len(graph_inputs) == 3 and all(len(inputs) == 1 for inputs in graph_inputs)


def test_a_kept_graph_leaves_a_host_scalar_in_the_graph_and_hands_over_the_device_products():
    """A compiled graph may save a host scalar beside its device tensors: the pipeline gets only the device's as
    products (it moves them, and the host's would not move), the scalar stays in the graph for its backward."""
    from megatrain_templates.kept_graph import KeptGraphs

    x, weights = torch.randn(2, 3, device="meta"), torch.randn(3, device="meta")
    scale = torch.tensor(2.0)  # (a 0-dim host tensor computes with any device's)
    leaf = weights.detach().requires_grad_(True)
    kept = KeptGraphs()
    y, products = kept.forward(lambda x: (x * leaf).exp() * scale, x, [weights], [leaf])
    assert products and all(p.device == x.device for p in products.values())
    grad_x, grad_weights = kept.backward(products, x, [weights], torch.ones(2, 3, device="meta"))
    assert grad_x.shape == x.shape and grad_weights.shape == weights.shape


@pytest.mark.parametrize("targets", [("all-linear",), ("q_proj", "down_proj"), ("gate_proj", "up_proj", "gate")])
def test_lora_on_a_moe_layers_experts_and_router_matches_merged_weights(targets):
    """float64: LoRA on the experts' fused matrices (each expert's own A and B, in PEFT 0.22's [n_experts * R, in] and
    [out, R * n_experts] layouts; the gate-up matrix at rank 2r) and on the router computes the block whose every
    matrix is W + scale * B A, and its backward (recomputed, or from kept products) gives autograd's gradients of
    the adapters through that merge, the frozen base getting none."""
    torch.manual_seed(torch.seed() % 2**31)
    d, heads, head_dim, eps, n_experts, top_k, d_ff, r = 32, 4, 8, 1e-5, 6, 2, 24, 2
    rope = RopeConfig(head_dim=head_dim, theta=500.0)
    shape = BlockShape(d, heads, 2, head_dim, 1, eps, rope=rope)
    lora = Lora(r, 3.0, targets)
    block = MoeBlock(shape, MoeShape(n_experts, top_k, d_ff, 40, lora_reaches_experts=True), lora=lora)
    ref = RefMoeBlock(d, heads, 2, head_dim, eps, rope_inv_freq(rope), n_experts, top_k, d_ff, 40, False).double()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    base_specs, adapter_specs = block.groups
    flat, adapters = flatten_params(ref, base_specs), torch.randn(total_numel(adapter_specs), dtype=torch.float64)
    named = {s.name: t.clone().requires_grad_(True) for s, t in zip(adapter_specs, _split(adapters, adapter_specs))}
    assert {"mlp.experts.lora_A.weight", "mlp.gate.lora_A.weight"} & set(named)  # (the experts' or the router's)

    def merged() -> dict:  # the reference's parameters, each adapted matrix W + scale * B A
        params = dict(ref.named_parameters())
        for name in [n for n in named if n.endswith(".lora_A.weight")]:
            module = name.removesuffix(".lora_A.weight")
            if ".experts" not in module:  # (the router's, attention's, shared expert's: plain LoRA)
                delta = lora.scale * named[f"{module}.lora_B.weight"] @ named[name]
                params[f"{module}.weight"] = params[f"{module}.weight"] + delta
                continue
            delta = _expert_delta(named, module, n_experts, lora.scale)  # [E, d, d_ff] or [E, 2 d_ff, d]
            halves = (
                {"down_proj": slice(None)}
                if delta.shape[1] == d
                else {"gate_proj": slice(0, d_ff), "up_proj": slice(d_ff, None)}
            )
            for e in range(n_experts):
                for projection, rows in halves.items():
                    key = f"mlp.experts.{e}.{projection}.weight"
                    params[key] = params[key] + delta[e, rows]
        return params

    x = torch.randn(3, 11, d, dtype=torch.float64)
    grad_out = torch.randn(3, 11, d, dtype=torch.float64)
    out_ref = torch.func.functional_call(ref, merged(), (x,))
    (out_ref * grad_out).sum().backward()
    out = block.forward([flat, adapters], x)
    assert rel_err(out, out_ref) < 1e-10
    for products in (None, block.forward_keeping_products([flat, adapters], x)[1]):
        grads = [None, torch.full_like(adapters, 0.5)]  # (gradients added, not written; the base's frozen)
        block.backward([flat, adapters], x, grad_out, grads, products=products)
        by_name = unflatten_grads(grads[1] - 0.5, adapter_specs)
        for name, leaf in named.items():
            assert rel_err(by_name[name], leaf.grad) < 1e-10, (name, products is not None)


def _split(flat: torch.Tensor, specs) -> list:
    return list(unflatten_grads(flat, specs).values())


def _expert_delta(named: dict, module: str, n_experts: int, scale: float) -> torch.Tensor:
    """[n_experts, out, in]: scale * B_e A_e of PEFT's expert adapters (A [E * R, in] rows e*R.., B [out, R * E]
    columns e, e + E, ...), written out with einsum (the template's grouped GEMMs are another algorithm)."""
    a, b = named[f"{module}.lora_A.weight"], named[f"{module}.lora_B.weight"]
    rank = a.shape[0] // n_experts
    return scale * torch.einsum("ore,eri->eoi", b.view(b.shape[0], rank, n_experts), a.view(n_experts, rank, -1))


def test_naming_one_half_of_the_experts_fused_gate_up_matrix_is_refused():
    shape = BlockShape(32, 4, 2, 8, 1, 1e-5, rope=RopeConfig(head_dim=8, theta=500.0))
    moe = MoeShape(6, 2, 24, lora_reaches_experts=True)
    with pytest.raises(
        ValueError, match="names up_proj but not gate_proj: each expert's gate_proj and up_proj are one"
    ):
        MoeBlock(shape, moe, lora=Lora(2, 3.0, ("q_proj", "up_proj")))
    with pytest.raises(ValueError, match="model.adapter.dropout 0.1 on experts_down"):
        MoeBlock(shape, moe, lora=Lora(2, 3.0, ("down_proj",), dropout=0.1))
