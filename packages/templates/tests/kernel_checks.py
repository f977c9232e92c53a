"""The Triton kernels against what they stand for, on a device: the GPU tests call these on CUDA;
`test_kernels_interpreted.py` runs this file on the CPU under Triton's interpreter, in a process of its own (the
interpreter must be on before anything imports triton: TRITON_INTERPRET=1 in its environment).

    TRITON_INTERPRET=1 python packages/templates/tests/kernel_checks.py experts|swiglu|dispatch|CASE  (CASE: of DELTA_CASES)
"""

import sys

import torch
import torch.nn.functional as F
from reference import rel_err

from megatrain_templates import chunked_recurrence as recurrence
from megatrain_templates import delta_kernels
from megatrain_templates.expert_kernels import COPY_TILES, Tiles, _descriptors, add_grouped_weight_grad_, copy_to_rows
from megatrain_templates.grouped_experts import _Slots


def _rule_inputs(heads, n_chunks, chunk, d_k, d_v, with_beta: bool, with_docs: bool, device: str):
    """Random inputs in the kernels' layout ([batch, heads, chunks, chunk, d]) with unit keys (as Gated DeltaNet's:
    I + L is then well conditioned), and document ids that start documents inside chunks."""
    batch, seq = 2, n_chunks * chunk

    def randn(*shape, scale=1.0):
        return torch.randn(batch, heads, n_chunks, *shape, device=device) * scale

    q, k, v, d_out = randn(chunk, d_k, scale=0.3), randn(chunk, d_k), randn(chunk, d_v), randn(chunk, d_v)
    log_decay = -torch.rand(batch, heads, n_chunks, chunk, device=device) * 0.5
    beta = torch.rand(batch, heads, n_chunks, chunk, device=device) if with_beta else None
    docs = None
    if with_docs:
        lengths = (chunk // 2 + 3, 1, seq - chunk // 2 - 4 - chunk, chunk)
        docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).expand(batch, -1).to(device)
    return q, F.normalize(k, dim=-1), v, log_decay, beta, docs, d_out


SMALL_STEPS = {  # every kernel that walks keys or values in steps, at its smallest
    "chunk_backward_states": delta_kernels.Launch(block_v=16, key_step=16, num_warps=4, num_stages=1),
    "chunk_backward_ut": delta_kernels.Launch(block_v=None, key_step=16, num_warps=4, num_stages=1),
    "chunk_prepare": delta_kernels.Launch(block_v=16),
    "chunk_backward_prepare": delta_kernels.Launch(block_v=16),
    "chunk_output": delta_kernels.Launch(block_v=16),
    "state_pass_forward": delta_kernels.Launch(block_v=16, num_warps=None),
    "state_pass_backward": delta_kernels.Launch(block_v=16, num_warps=None),
}


DELTA_CASES = {  # (heads, chunks, chunk, d_k, d_v, with beta, with documents, launches)
    "qwen3.5-docs": (2, 3, 64, 128, 128, True, True, {}),
    "qwen3.5-docs-small-steps": (1, 3, 64, 128, 128, True, True, SMALL_STEPS),
    "narrow-values-small-steps": (3, 4, 16, 32, 40, True, False, SMALL_STEPS),
    "ssd-docs": (2, 4, 32, 24, 16, False, True, {}),
}


def delta_kernels_equal_the_eager_functions(
    heads, n_chunks, chunk, d_k, d_v, with_beta, with_docs, launches, device: str = "cpu"
) -> None:
    """Every kernel of the chunked rule (the state pass both ways; before it, the UT inverse, u and w, and the
    backward's start; after it, the output and the gradients by q, k, v, log decay and beta) against the eager
    function it stands for, in fp32 with exact matmuls, on the same inputs: documents starting inside a chunk,
    value widths off the kernels' blocks, keys narrower than a tile, with and without the delta's beta."""
    defaults = dict(delta_kernels.LAUNCH)
    delta_kernels.LAUNCH.update(launches)
    try:
        got, expected = _kernels_and_eager(heads, n_chunks, chunk, d_k, d_v, with_beta, with_docs, device)
    finally:
        delta_kernels.LAUNCH.update(defaults)
    for i, (ours, reference) in enumerate(zip(got, expected, strict=True)):
        assert (ours is None) == (reference is None), f"output {i}: {ours is None=} {reference is None=}"
        if reference is not None:
            assert rel_err(ours, reference) < 1e-5, f"output {i}: relative error {rel_err(ours, reference):.2e}"


def _kernels_and_eager(heads, n_chunks, chunk, d_k, d_v, with_beta, with_docs, device):
    """Every kernel's outputs and the eager functions' on the same random inputs, in the same order."""
    q, k, v, log_decay, beta, docs, d_out = _rule_inputs(heads, n_chunks, chunk, d_k, d_v, with_beta, with_docs, device)
    masks = recurrence._chunk_masks(docs, q.shape[0], n_chunks, chunk, q.device)
    to_state_pass = recurrence._to_state_pass(k, v, log_decay, beta, *masks)
    u, w, k_end, carry, ut_inverse = to_state_pass
    states, delta = recurrence.state_pass(w, u, k_end, carry)
    back_to_state_pass = recurrence._back_to_state_pass(q, k, log_decay, beta, ut_inverse, *masks, d_out)
    d_u, d_leaving = recurrence.state_pass_backward(w, k_end, carry, states, *back_to_state_pass[-2:])
    after_pass = (states, delta, d_out, d_u, d_leaving)
    expected = [
        states,
        delta,
        d_u,
        d_leaving,
        recurrence._from_state_pass(q, k, log_decay, *masks, states, delta),
        *recurrence._back_from_state_pass(q, k, v, log_decay, beta, ut_inverse, *masks, *after_pass),
    ]
    got = [
        *delta_kernels.state_pass(w, u, k_end, carry, False),
        *delta_kernels.state_pass_backward(w, k_end, carry, *back_to_state_pass[-2:], False),
        delta_kernels.chunk_output(q, k, log_decay, states, delta, docs, False),
        *delta_kernels.chunk_backward(q, k, v, log_decay, beta, ut_inverse, *after_pass, docs, False),
    ]
    if with_beta:  # the kernels before the state pass take the delta rule's (Mamba-2's is elementwise)
        expected += [*to_state_pass, *back_to_state_pass]
        got += [
            *delta_kernels.chunk_prepare(k, v, log_decay, beta, docs, False),
            *delta_kernels.chunk_backward_prepare(q, k, log_decay, beta, ut_inverse, docs, d_out, False),
        ]
    return got, expected


def grouped_weight_gradient_kernel_adds_each_experts_rows():
    """into[e] += a[rows of e]^T b[rows of e] against float64, at tiles smaller than the widths and the experts' row
    counts (an expert with no rows untouched to the bit). fp32 operands: the interpreter's bf16 is not the GPU's."""
    torch.manual_seed(0)
    counts = [70, 0, 131, 1, 64, 200]
    a, b = torch.randn(sum(counts), 200), torch.randn(sum(counts), 96)
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    start = torch.randn(len(counts), 96, 200).transpose(1, 2)  # [experts, m, n] with n not unit-strided
    want, first = start.double(), 0
    for e, count in enumerate(counts):
        want[e] += a[first : first + count].double().T @ b[first : first + count].double()
        first += count
    # the rows read by masked loads, or their whole chunks by descriptors; rows not on 16 bytes (a view one element
    # into its storage) by masked loads where TMA is asked for
    misaligned = torch.empty(a.numel() + 1)[1:].view_as(a).copy_(a)
    assert (
        _descriptors(a, b, Tiles(32, 32, 32, 4, 1)) is not None
        and _descriptors(misaligned, b, Tiles(32, 32, 32, 4, 1)) is None
    )
    for rows, tma in ((a, False), (a, True), (misaligned, True)):
        into = start.clone()
        add_grouped_weight_grad_(into, rows, b, ends, Tiles(32, 32, 32, 4, 1, tma=tma))
        assert rel_err(into, want) < 1e-6, f"tma={tma}: relative error {rel_err(into, want):.2e}"
        assert torch.equal(into[1], start[1]), f"tma={tma}: an expert without rows changed"


def dispatch_copy_equals_the_gather(device: str = "cpu", dtype: torch.dtype = torch.float32):
    """`copy_to_rows`, each token's row written to its choices' rows, equals the gather of each row's token to the
    bit: for all the experts and for a stage's (the other choices not written), at a width off its column block and
    a token count off its token block, from a view whose rows are strided."""
    tokens, k, n_experts = 37, 3, 7
    choices = torch.stack([torch.randperm(n_experts)[:k] for _ in range(tokens)]).to(device)
    wide = torch.randn(tokens, COPY_TILES[1] + 60, device=device).to(dtype)
    for h in (wide, wide[:, 5:101]):  # the second's rows strided
        for first, stop in ((0, 0), (2, 5)):
            slots = _Slots.of_choices(choices, n_experts, first, stop, None, grouped=False)
            got = copy_to_rows(h, slots.inverse, slots.rows, k)
            case = f"width {h.shape[1]}, experts {first}..{stop or n_experts}"
            assert torch.equal(got, h.index_select(0, slots.token)), f"{case}: the copied rows differ"


def swiglu_kernels_equal_autograd():
    """The SwiGLU kernels' output and gradients (both halves', and a weighted one's weight's) against float64
    autograd, at a width off their block (a row's last block part masked) and at two blocks a row (the weight's
    gradient summed over them). fp32 operands: the interpreter's bf16 is not the GPU's. The one-pass kernel
    (`swiglu_output_and_backward`) gives the forward kernel's output bit for bit and the backward's gradients, also
    where it writes gate_up's gradient over gate_up."""
    from megatrain_templates.swiglu_kernels import BLOCK, SwiGLU, swiglu_output_and_backward

    for d_ff, weighted in ((BLOCK + 76, False), (BLOCK + 76, True), (300, True)):
        gate_up = (torch.randn(2, 3, 2 * d_ff) * 3).requires_grad_(True)
        weight = torch.rand(2, 3, 1).requires_grad_(True) if weighted else None
        grad = torch.randn(2, 3, d_ff)
        inputs = (gate_up,) if weight is None else (gate_up, weight)
        out = SwiGLU.apply(*inputs)
        got = torch.autograd.grad(out, inputs, grad)
        exact = [t.detach().double().requires_grad_(True) for t in inputs]
        gate, up = exact[0].chunk(2, dim=-1)
        want = torch.nn.functional.silu(gate) * up * (exact[1] if weighted else 1.0)
        wanted = torch.autograd.grad(want, exact, grad.double())
        case = f"d_ff {d_ff}, weighted {weighted}"
        assert rel_err(out, want) < 1e-6, f"{case}: output: relative error {rel_err(out, want):.2e}"
        for name, ours, theirs in zip(("gate_up", "weight"), got, wanted):
            assert rel_err(ours, theirs) < 1e-6, (
                f"{case}: {name}'s gradient: relative error {rel_err(ours, theirs):.2e}"
            )
        plain_weight = None if weight is None else weight.detach()
        one_pass = swiglu_output_and_backward(gate_up.detach(), grad, plain_weight)
        assert torch.equal(one_pass[0], out.detach()), f"{case}: the one-pass kernel's output differs"
        for name, ours, theirs in zip(("gate_up", "weight"), one_pass[1:], got):
            assert torch.equal(ours, theirs), f"{case}: the one-pass kernel's {name} gradient differs"
        overwritten = gate_up.detach().clone()
        in_place = swiglu_output_and_backward(overwritten, grad, plain_weight, overwrite=True)
        assert in_place[1].data_ptr() == overwritten.data_ptr(), f"{case}: the gradient was not written over gate_up"
        for name, ours, theirs in zip(("output", "gate_up's gradient", "weight's gradient"), in_place, one_pass):
            assert (ours is None and theirs is None) or torch.equal(ours, theirs), (
                f"{case}: over gate_up, {name} differs"
            )


if __name__ == "__main__":
    torch.manual_seed(torch.seed() % 2**31)
    if sys.argv[1] == "experts":
        grouped_weight_gradient_kernel_adds_each_experts_rows()
    elif sys.argv[1] == "swiglu":
        swiglu_kernels_equal_autograd()
    elif sys.argv[1] == "dispatch":
        dispatch_copy_equals_the_gather()
    else:
        delta_kernels_equal_the_eager_functions(*DELTA_CASES[sys.argv[1]])
