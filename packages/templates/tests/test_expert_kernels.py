"""The experts' weight gradients added into their fp32 buffer: on the GPU by the grouped kernel that accumulates in
fp32 (`expert_kernels`), on the CPU by the loop; both against float64. LoRA adapters on the experts likewise."""

import pytest
import torch

from megatrain_templates import Lora
from megatrain_templates.expert_adapters import ExpertAdapters
from megatrain_templates.grouped_experts import (
    _grouped_linear,
    _grouped_linear_backward,
    _low_rank_slots,
    _Slots,
    adapters_input_grad,
    add_adapters_weight_grads,
)
from megatrain_templates.layout import BoundWeight, Span, span_of, total_numel


def _slots(counts: list[int], k: int, device: str) -> _Slots:
    """Rows grouped by expert, `counts` rows each (the tokens' order is the rows' own: only the grouping matters)."""
    expert = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts)).to(device)
    order = torch.arange(expert.numel(), device=device)
    return _Slots(order, order // k, expert, order, k, len(counts), grouped=device == "cuda")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("out_in", [True, False], ids=["out_in", "in_out"])
def test_expert_weight_gradients_add_into_their_buffer_like_float64(device, out_in):
    """x [rows, in] times each expert's weight: the weight gradient added into `into` (a view of an fp32 buffer,
    in either storage orientation) equals float64's sum of each expert's rows, an expert no row chose untouched to
    the bit; the input's gradient too. Widths and row counts off the kernel's tiles test its edges."""
    torch.manual_seed(0)
    counts = [70, 0, 131, 1, 64, 200]  # expert 1: no rows
    d_in, d_out = 200, 96
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    slots = _slots(counts, 2, device)
    x = torch.randn(sum(counts), d_in, device=device).to(dtype)
    grad = torch.randn(sum(counts), d_out, device=device).to(dtype)
    weight = (torch.randn(len(counts), d_out, d_in, device=device) * 0.1).to(dtype)  # [experts, out, in]
    stored = torch.randn(len(counts), *((d_out, d_in) if out_in else (d_in, d_out)), device=device)
    into = stored.clone()
    as_in_out = into.transpose(1, 2) if out_in else into  # [experts, in, out], the backward's view
    weight_in_out = weight.transpose(1, 2) if out_in else weight.transpose(1, 2).contiguous()
    grad_x, returned = _grouped_linear_backward(x, weight_in_out, grad, slots, as_in_out)
    assert returned is None
    want, first = stored.double().clone(), 0
    for e, count in enumerate(counts):
        rows = slice(first, first + count)
        product = x[rows].double().T @ grad[rows].double()  # [in, out]
        want[e] += product.T if out_in else product
        first += count
    error = (into.double() - want).norm() / want.norm()
    assert error < 1e-5, error  # fp32 sums of exact products; a bf16-rounded sum would be off by ~1e-3
    assert torch.equal(into[1], stored[1])
    want_x = torch.cat([grad[slots.expert == e].double() @ weight[e].double() for e in range(len(counts)) if counts[e]])
    assert ((grad_x.double() - want_x).norm() / want_x.norm()) < (1e-2 if device == "cuda" else 1e-6)


def test_slots_end_rows_count_each_experts_rows():
    """`offsets`, the end row of each expert that the grouped kernels read, for experts with no rows first, between
    and last."""
    counts = [0, 3, 0, 0, 5, 1, 0, 0]
    ends = _slots(counts, 1, "cpu").offsets
    assert ends.dtype == torch.int32
    assert ends.tolist() == torch.tensor(counts).cumsum(0).tolist()


def test_wide_tiles_where_experts_sum_many_rows_into_wide_matrices():
    """The weight-gradient kernel's tiles by shape: twice as wide for OLMoE's gate-up at 32k tokens a micro-batch
    (4,096 rows an expert, 2,048 columns), the default at 16k, for its down projection (1,024 columns) and for
    DeepSeek-V3's 512 rows an expert."""
    from megatrain_templates.expert_kernels import DEFAULT_TILES, WIDE_TILES, tiles_for

    assert tiles_for(32768 * 8, 64, 2048) == WIDE_TILES
    assert tiles_for(16384 * 8, 64, 2048) == DEFAULT_TILES
    assert tiles_for(32768 * 8, 64, 1024) == DEFAULT_TILES
    assert tiles_for(16384 * 8, 256, 7168) == DEFAULT_TILES


@pytest.mark.gpu
def test_gpu_wide_tiles_add_each_experts_rows_like_float64():
    """The kernel with its wide tiles, at widths and row counts off them (an expert with no rows untouched to the
    bit), against float64."""
    from megatrain_templates.expert_kernels import WIDE_TILES, add_grouped_weight_grad_

    torch.manual_seed(0)
    counts = [70, 0, 131, 1, 64, 300]
    a = torch.randn(sum(counts), 200, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(sum(counts), 520, device="cuda", dtype=torch.bfloat16)
    start = torch.randn(len(counts), 200, 520, device="cuda")
    into = start.clone()
    add_grouped_weight_grad_(into, a, b, torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32), WIDE_TILES)
    want, first = start.double(), 0
    for e, count in enumerate(counts):
        want[e] += a[first : first + count].double().T @ b[first : first + count].double()
        first += count
    assert ((into.double() - want).norm() / want.norm()) < 1e-5
    assert torch.equal(into[1], start[1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_dispatch_copies_each_tokens_row_to_its_choices_rows(dtype):
    """The compiled `copy_to_rows` equals the gather of each row's token to the bit (`kernel_checks`, which CI runs
    under Triton's interpreter)."""
    from kernel_checks import dispatch_copy_equals_the_gather

    torch.manual_seed(0)
    dispatch_copy_equals_the_gather("cuda", dtype)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("rank", [4, 8])
def test_expert_adapters_follow_float64(device, rank):
    """LoRA on experts' matrices in PEFT 0.22's layouts (A [E * R, in], B [out, R * E], in an fp32 gradient buffer
    and bound by `ExpertAdapters`): the grouped linear's output, its input's gradient and the adapters' gradients
    through autograd, and the by-hand backward's (`adapters_input_grad`, `add_adapters_weight_grads`), against
    float64. In bf16 on the GPU (the low-rank products rounded to bf16) rank 8 runs the grouped kernel, rank 4
    (8-byte rows) the loop."""
    torch.manual_seed(rank)
    counts, d_in, d_out, scale = [70, 0, 131, 1, 64], 40, 24, 2.0
    n_experts, dtype = len(counts), torch.bfloat16 if device == "cuda" else torch.float32
    lora = Lora(rank, rank * scale, ("down_proj",))
    layout = ExpertAdapters(lora, {"experts_down": Span(0, (n_experts, d_out, d_in))}, ("experts_down",), "mlp", 0)
    slots = _slots(counts, 2, device)
    x = torch.randn(sum(counts), d_in, device=device).to(dtype)
    grad = torch.randn(sum(counts), d_out, device=device).to(dtype)
    base = (torch.randn(n_experts, d_out, d_in, device=device) * 0.1).to(dtype)
    buffer = (torch.randn(total_numel(layout.params), device=device) * 0.3).to(dtype)

    a64, b64 = (t.double().cpu().requires_grad_(True) for t in (s.view(buffer) for s in _adapter_spans(layout)))
    x64 = x.double().cpu().requires_grad_(True)
    want = []
    for e, rows in _runs(counts):
        a_e, b_e = a64.view(n_experts, rank, d_in)[e], b64.view(d_out, rank, n_experts)[:, :, e]
        want.append(x64[rows] @ base[e].double().cpu().T + scale * (x64[rows] @ a_e.T) @ b_e.T)
    want = torch.cat(want)
    want.backward(grad.double().cpu())
    tolerance = 2e-2 if device == "cuda" else 1e-5

    def close(ours, theirs, tol=tolerance):
        return ((ours.double().cpu() - theirs).norm() / theirs.norm()).item() < tol

    grads = torch.zeros(total_numel(layout.params), device=device)
    x_leaf = x.clone().requires_grad_(True)
    adapted = layout.bind({"experts_down": BoundWeight(base, None)}, buffer, grads)["experts_down"]
    out = _grouped_linear(x_leaf, adapted, slots, out_in=True)
    out.backward(grad)
    assert close(out, want.detach()) and close(x_leaf.grad, x64.grad)
    grad_a, grad_b = (s.view(grads) for s in _adapter_spans(layout))
    assert close(grad_a, a64.grad) and close(grad_b, b64.grad)  # (of bf16's low-rank products, summed in fp32)

    by_hand = torch.zeros_like(grads)
    adapted = layout.bind({"experts_down": BoundWeight(base, None)}, buffer, by_hand)["experts_down"]
    low_slots = _low_rank_slots(adapted, grad, slots)
    assert low_slots.grouped == (device == "cuda" and rank == 8)
    grad_low, grad_x_delta = adapters_input_grad(adapted, grad.contiguous(), low_slots)
    add_adapters_weight_grads(adapted, x, grad.contiguous(), grad_low, low_slots)
    grad_a, grad_b = (s.view(by_hand) for s in _adapter_spans(layout))
    assert close(grad_a, a64.grad) and close(grad_b, b64.grad)
    base_grad_x = torch.cat([grad[rows].double().cpu() @ base[e].double().cpu() for e, rows in _runs(counts)])
    assert close(grad_x_delta, x64.grad - base_grad_x)


def _adapter_spans(layout: ExpertAdapters) -> list[Span]:
    return [span_of(layout.params, p.name) for p in layout.params]


def _runs(counts: list[int]):
    """(expert, its rows) of rows grouped by expert, `counts` each, the experts with rows."""
    first = 0
    for e, count in enumerate(counts):
        if count:
            yield e, slice(first, first + count)
        first += count
