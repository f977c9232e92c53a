"""The Triton kernels behind `delta_kernels` (imported only where one runs: on CUDA, or under Triton's CPU
interpreter)."""

import triton
import triton.language as tl


@triton.jit
def state_pass_forward(
    w_ptr, u_ptr, k_ptr, carry_ptr, states_ptr, delta_ptr, n_chunks, d_k, d_v,
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, HAS_W: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(0).to(tl.int64)
    ks, vs, k_in, v_in = state_columns(tl.program_id(1), d_k, d_v, BLOCK_K, BLOCK_V)
    state = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    for c in range(n_chunks):
        chunk = head * n_chunks + c
        tl.store(states_ptr + state_tile(chunk, ks, vs, d_k, d_v), state, k_in[:, None] & v_in[None, :])
        rows_v, rows_k = token_tile(chunk, vs, d_v, CHUNK), token_tile(chunk, ks, d_k, CHUNK)
        delta = tl.load(u_ptr + rows_v, mask=v_in[None, :], other=0.0)
        if HAS_W:
            w = tl.load(w_ptr + rows_k, mask=k_in[None, :], other=0.0)
            delta -= tl.dot(w, state, input_precision=PRECISION)
            tl.store(delta_ptr + rows_v, delta, mask=v_in[None, :])
        keys = tl.load(k_ptr + rows_k, mask=k_in[None, :], other=0.0)
        state = state * tl.load(carry_ptr + chunk) + tl.dot(tl.trans(keys), delta, input_precision=PRECISION)


@triton.jit
def state_pass_backward(
    w_ptr, k_ptr, carry_ptr, d_states_ptr, d_delta_ptr, d_delta_total_ptr, d_leaving_ptr, n_chunks, d_k, d_v,
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, HAS_W: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(0).to(tl.int64)
    ks, vs, k_in, v_in = state_columns(tl.program_id(1), d_k, d_v, BLOCK_K, BLOCK_V)
    state_mask = k_in[:, None] & v_in[None, :]
    d_leaving = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)  # by the state leaving chunk c
    for back in range(n_chunks):
        chunk = head * n_chunks + (n_chunks - 1 - back)
        states_at = state_tile(chunk, ks, vs, d_k, d_v)
        tl.store(d_leaving_ptr + states_at, d_leaving, state_mask)
        rows_v, rows_k = token_tile(chunk, vs, d_v, CHUNK), token_tile(chunk, ks, d_k, CHUNK)
        keys = tl.load(k_ptr + rows_k, mask=k_in[None, :], other=0.0)
        d_delta = tl.load(d_delta_ptr + rows_v, mask=v_in[None, :], other=0.0)
        d_delta += tl.dot(keys, d_leaving, input_precision=PRECISION)
        tl.store(d_delta_total_ptr + rows_v, d_delta, mask=v_in[None, :])
        entering = tl.load(d_states_ptr + states_at, mask=state_mask, other=0.0)
        d_leaving = entering + tl.load(carry_ptr + chunk) * d_leaving  # by the state entering chunk c
        if HAS_W:
            w = tl.load(w_ptr + rows_k, mask=k_in[None, :], other=0.0)
            d_leaving -= tl.dot(tl.trans(w), d_delta, input_precision=PRECISION)


@triton.jit
def chunk_program(
    log_decay_ptr, docs_ptr, n_chunks, n_heads, d_k, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, HAS_DOCS: tl.constexpr
):
    """A chunk-local program's chunk (program ids: the chunk within its row and head, the row and head), its index
    among all heads' chunks; its rows and key columns, which of those are keys, the offsets of its [C, d_k] tiles;
    and its decays (`chunk_decays`)."""
    c, head = tl.program_id(0), tl.program_id(1).to(tl.int64)
    chunk = head * n_chunks + c
    ks = tl.arange(0, BLOCK_K)
    pairs, carried, to_end, carry = chunk_decays(
        log_decay_ptr, docs_ptr, chunk, c, n_chunks, head // n_heads, CHUNK, HAS_DOCS
    )
    return chunk, tl.arange(0, CHUNK), ks, ks < d_k, token_tile(chunk, ks, d_k, CHUNK), pairs, carried, to_end, carry


@triton.jit
def chunk_decays(log_decay_ptr, docs_ptr, chunk, c, n_chunks, batch, CHUNK: tl.constexpr, HAS_DOCS: tl.constexpr):
    """One chunk's decays (`chunked_recurrence._decays`) from its log decays and document ids: (decayed
    positions, kept pairs [C, C], the carried state's decay, each update's decay to the chunk's end, the
    state's decay across the chunk)."""
    rows = tl.arange(0, CHUNK)
    decayed = tl.cumsum(tl.load(log_decay_ptr + chunk * CHUNK + rows), axis=0)
    last = tl.sum(tl.where(rows == CHUNK - 1, decayed, 0.0), axis=0)
    causal = rows[:, None] >= rows[None, :]
    carried, to_end, carry = tl.exp(decayed), tl.exp(last - decayed), tl.exp(last)
    if HAS_DOCS:
        docs_at = docs_ptr + (batch * n_chunks + c) * CHUNK
        doc = tl.load(docs_at + rows)
        before = tl.load(docs_at - 1, mask=c > 0, other=-1)  # the document of the token before the chunk
        last_doc = tl.sum(tl.where(rows == CHUNK - 1, doc, 0), axis=0)
        causal = causal & (doc[:, None] == doc[None, :])
        carried = tl.where(doc == before, carried, 0.0)
        to_end = tl.where(doc == last_doc, to_end, 0.0)
        carry = tl.where(last_doc == before, carry, 0.0)
    pairs = tl.where(causal, tl.exp(decayed[:, None] - decayed[None, :]), 0.0)
    return pairs, carried, to_end, carry


@triton.jit
def chunk_prepare(
    k_ptr, v_ptr, log_decay_ptr, beta_ptr, docs_ptr, ut_inverse_ptr, u_ptr, w_ptr, k_end_ptr, carry_ptr, n_chunks,
    n_heads, d_k, d_v,
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, HAS_DOCS: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """The forward up to the state pass (`chunked_recurrence._to_state_pass`, with beta): T = (I + L)^-1, u, w,
    the keys decayed to the chunk's end and the chunk's carry."""
    chunk, rows, ks, k_in, rows_k, pairs, carried, to_end, carry = chunk_program(
        log_decay_ptr, docs_ptr, n_chunks, n_heads, d_k, CHUNK, BLOCK_K, HAS_DOCS
    )
    k = tl.load(k_ptr + rows_k, mask=k_in[None, :], other=0.0)
    beta = tl.load(beta_ptr + chunk * CHUNK + rows)
    system = tl.dot(k * beta[:, None], tl.trans(k), input_precision=PRECISION) * pairs
    ut_addresses = ut_at(ut_inverse_ptr, chunk, CHUNK)
    tl.store(ut_addresses, tl.where(rows[:, None] > rows[None, :], system, 0.0))
    unit_lower_inverse(ut_inverse_ptr + chunk * CHUNK * CHUNK, CHUNK)
    ut_inverse = tl.load(ut_addresses)
    keys_for_state_pass(k, beta, ut_inverse, carried, to_end, carry, chunk, rows_k, k_in, w_ptr, k_end_ptr, carry_ptr,
                        PRECISION)  # fmt: skip
    for v0 in range(0, d_v, BLOCK_V):
        vs = v0 + tl.arange(0, BLOCK_V)
        rows_v = token_tile(chunk, vs, d_v, CHUNK)
        v = tl.load(v_ptr + rows_v, mask=(vs < d_v)[None, :], other=0.0)
        u = tl.dot(ut_inverse, v * beta[:, None], input_precision=PRECISION)
        tl.store(u_ptr + rows_v, u, mask=(vs < d_v)[None, :])


@triton.jit
def chunk_backward_prepare(
    q_ptr, k_ptr, log_decay_ptr, beta_ptr, ut_inverse_ptr, docs_ptr, d_out_ptr, w_ptr, k_end_ptr, carry_ptr,
    d_states_ptr, d_delta_ptr, n_chunks, n_heads, d_k, d_v,
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, HAS_DOCS: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """The backward up to the state pass's (`chunked_recurrence._back_to_state_pass`, with beta): w, the keys
    decayed to the chunk's end and the carry again, and the gradients by the state entering the chunk and by
    the corrected values that the output gives."""
    chunk, rows, ks, k_in, rows_k, pairs, carried, to_end, carry = chunk_program(
        log_decay_ptr, docs_ptr, n_chunks, n_heads, d_k, CHUNK, BLOCK_K, HAS_DOCS
    )
    q = tl.load(q_ptr + rows_k, mask=k_in[None, :], other=0.0)
    k = tl.load(k_ptr + rows_k, mask=k_in[None, :], other=0.0)
    beta = tl.load(beta_ptr + chunk * CHUNK + rows)
    ut_inverse = tl.load(ut_at(ut_inverse_ptr, chunk, CHUNK))
    keys_for_state_pass(k, beta, ut_inverse, carried, to_end, carry, chunk, rows_k, k_in, w_ptr, k_end_ptr, carry_ptr,
                        PRECISION)  # fmt: skip
    attention_transposed = tl.trans(tl.dot(q, tl.trans(k), input_precision=PRECISION) * pairs)
    q_carried_transposed = tl.trans(q * carried[:, None])
    for v0 in range(0, d_v, BLOCK_V):
        vs = v0 + tl.arange(0, BLOCK_V)
        v_in = vs < d_v
        rows_v = token_tile(chunk, vs, d_v, CHUNK)
        d_out = tl.load(d_out_ptr + rows_v, mask=v_in[None, :], other=0.0)
        d_states = tl.dot(q_carried_transposed, d_out, input_precision=PRECISION)
        tl.store(d_states_ptr + state_tile(chunk, ks, vs, d_k, d_v), d_states, mask=k_in[:, None] & v_in[None, :])
        tl.store(d_delta_ptr + rows_v, tl.dot(attention_transposed, d_out, input_precision=PRECISION), v_in[None, :])


@triton.jit
def keys_for_state_pass(
    k, beta, ut_inverse, carried, to_end, carry, chunk, rows_k, k_in, w_ptr, k_end_ptr, carry_ptr, PRECISION
):
    """Stores what the state pass reads besides u: w = T (beta k o carried), k_end = k o to_end, the carry."""
    w = tl.dot(ut_inverse, k * (beta * carried)[:, None], input_precision=PRECISION)
    tl.store(w_ptr + rows_k, w, mask=k_in[None, :])
    tl.store(k_end_ptr + rows_k, k * to_end[:, None], mask=k_in[None, :])
    tl.store(carry_ptr + chunk, carry)


@triton.jit
def unit_lower_inverse(at, CHUNK: tl.constexpr):
    """Replaces the strictly lower [C, C] L at `at` (row-major, zero above the diagonal) by (I + L)^-1, by forward
    substitution in blocks of 16 rows: each diagonal block's inverse row by row (all blocks at once), then each
    block below the diagonal from those above it, T_ij = -T_ii sum_{j <= m < i} L_im T_mj. fp32 throughout
    (the blocks' matmuls too: they are small, and an inverse amplifies rounding)."""
    B: tl.constexpr = 16
    N_BLOCKS: tl.constexpr = CHUNK // B
    tl.debug_barrier()  # L as all the program's threads stored it
    blocks, i = tl.arange(0, N_BLOCKS), tl.arange(0, B)
    corner = blocks[:, None, None] * (B * CHUNK + B)  # each diagonal block's first element, [N_BLOCKS, 1, 1]
    inverse = tl.where(i[:, None] == i[None, :], 1.0, 0.0)[None, :, :] + tl.zeros([N_BLOCKS, B, B], tl.float32)
    for r in range(1, B):
        row = tl.load(at + corner + r * CHUNK + i[None, :, None])  # [N_BLOCKS, B, 1]: L's row r in each block
        new_row = tl.where(i[None, None, :] == r, 1.0, 0.0) - tl.sum(row * inverse, axis=1)[:, None, :]
        inverse = tl.where(i[None, :, None] == r, new_row, inverse)
    tl.debug_barrier()  # every thread has read the diagonal blocks of L
    tl.store(at + corner + i[None, :, None] * CHUNK + i[None, None, :], inverse)
    tl.debug_barrier()
    for bi in tl.static_range(1, N_BLOCKS):
        diagonal = tl.load(at + block_at(bi, bi, CHUNK))
        for bj in tl.static_range(0, bi):
            total = tl.zeros([B, B], tl.float32)
            for m in tl.static_range(bj, bi):
                total += tl.dot(tl.load(at + block_at(bi, m, CHUNK)), tl.load(at + block_at(m, bj, CHUNK)),
                                input_precision="ieee")  # fmt: skip
            below = -tl.dot(diagonal, total, input_precision="ieee")
            tl.debug_barrier()  # L_ij read by every thread before T_ij replaces it
            tl.store(at + block_at(bi, bj, CHUNK), below)
        tl.debug_barrier()


@triton.jit
def block_at(bi, bj, CHUNK: tl.constexpr):
    """The offsets of block (bi, bj) of 16 x 16 in a row-major [C, C]."""
    i = tl.arange(0, 16)
    return (bi * 16 + i[:, None]) * CHUNK + bj * 16 + i[None, :]


@triton.jit
def chunk_output(
    q_ptr, k_ptr, log_decay_ptr, states_ptr, delta_ptr, docs_ptr, out_ptr, n_chunks, n_heads, d_k, d_v,
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, HAS_DOCS: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    chunk, _, ks, k_in, rows_k, pairs, carried, _, _ = chunk_program(
        log_decay_ptr, docs_ptr, n_chunks, n_heads, d_k, CHUNK, BLOCK_K, HAS_DOCS
    )
    vs = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_in, rows_v = vs < d_v, token_tile(chunk, vs, d_v, CHUNK)
    q = tl.load(q_ptr + rows_k, mask=k_in[None, :], other=0.0)
    k = tl.load(k_ptr + rows_k, mask=k_in[None, :], other=0.0)
    states = tl.load(states_ptr + state_tile(chunk, ks, vs, d_k, d_v), mask=k_in[:, None] & v_in[None, :], other=0.0)
    delta = tl.load(delta_ptr + rows_v, mask=v_in[None, :], other=0.0)
    attention = tl.dot(q, tl.trans(k), input_precision=PRECISION) * pairs
    out = tl.dot(q * carried[:, None], states, input_precision=PRECISION)
    out += tl.dot(attention, delta, input_precision=PRECISION)
    tl.store(out_ptr + rows_v, out, mask=v_in[None, :])


@triton.jit
def chunk_backward_states(
    q_ptr, k_ptr, v_ptr, log_decay_ptr, beta_ptr, ut_inverse_ptr, states_ptr, delta_ptr, d_out_ptr, d_u_ptr,
    d_leaving_ptr, docs_ptr, d_q_ptr, d_k_ptr, d_v_ptr, d_log_decay_ptr, d_beta_ptr, d_w_ptr, d_t_ptr, n_chunks,
    n_heads, d_k, d_v,
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, KEY_STEP: tl.constexpr,
    HAS_BETA: tl.constexpr, HAS_DOCS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The gradients through the states, the corrected values and the output's masked attention: d_q, d_v,
    and d_k, d_beta and the log decays' whole (without beta) or their part before the UT transform's (with
    it: then also the gradients by w and T, for `chunk_backward_ut`). First the sums over the value columns
    that take no key column (the attention's gradient, v's, T's and beta's); then the key columns KEY_STEP at a
    time, each step walking the value columns again, so that the sums it holds in registers are [C, KEY_STEP].
    Registers, not arithmetic, bound these programs: each [C, C] or [C, d] fp32 tile held is 16-32 KB."""
    chunk, rows, _, _, _, pairs, carried, to_end, carry = chunk_program(
        log_decay_ptr, docs_ptr, n_chunks, n_heads, d_k, CHUNK, BLOCK_K, HAS_DOCS
    )
    d_scores = pairs * value_side_gradients(
        v_ptr, beta_ptr, ut_inverse_ptr, delta_ptr, d_out_ptr, d_u_ptr, d_v_ptr, d_t_ptr, d_beta_ptr, chunk, rows,
        d_v, CHUNK, BLOCK_V, HAS_BETA, PRECISION,
    )  # fmt: skip
    by_pairs = tl.zeros([CHUNK], dtype=tl.float32)  # the decayed positions' gradient through the attention's pairs
    by_queries = tl.zeros([CHUNK], dtype=tl.float32)  # the carried decay's gradient, less its decay
    by_end = tl.zeros([CHUNK], dtype=tl.float32)
    d_carry = 0.0
    for k0 in tl.static_range(0, BLOCK_K, KEY_STEP):
        ks = k0 + tl.arange(0, KEY_STEP)
        k_in = ks < d_k
        d_q_carried, d_k_end, d_w, d_carry_part = key_step_sums(
            states_ptr, d_leaving_ptr, d_out_ptr, delta_ptr, d_u_ptr, chunk, ks, k_in, d_k, d_v,
            CHUNK, KEY_STEP, BLOCK_V, HAS_BETA, PRECISION,
        )  # fmt: skip
        d_carry += d_carry_part
        # through the output's masked attention and the keys' decays to the chunk's end, for these key columns
        rows_k = token_tile(chunk, ks, d_k, CHUNK)
        q = tl.load(q_ptr + rows_k, mask=k_in[None, :], other=0.0)
        k = tl.load(k_ptr + rows_k, mask=k_in[None, :], other=0.0)
        d_q_tile = tl.dot(d_scores, k, input_precision=PRECISION) + d_q_carried * carried[:, None]
        tl.store(d_q_ptr + rows_k, d_q_tile, mask=k_in[None, :])
        d_k_tile = tl.dot(tl.trans(d_scores), q, input_precision=PRECISION) + d_k_end * to_end[:, None]
        tl.store(d_k_ptr + rows_k, d_k_tile, mask=k_in[None, :])
        if HAS_BETA:
            tl.store(d_w_ptr + rows_k, d_w, mask=k_in[None, :])
        by_end += tl.sum(d_k_end * k, axis=1) * to_end
        by_queries += tl.sum(d_q_carried * q, axis=1)
        # the pairs' part of the decayed positions' gradient is linear in q k^T: summed a key step at a time
        by_pairs += pair_sums(d_scores * tl.dot(q, tl.trans(k), input_precision=PRECISION))
    d_decayed = by_pairs + by_queries * carried
    d_decayed += tl.where(rows == CHUNK - 1, tl.sum(by_end, axis=0) + d_carry * carry, 0.0) - by_end
    if HAS_BETA:  # the rest is `chunk_backward_ut`'s
        tl.store(d_log_decay_ptr + chunk * CHUNK + rows, d_decayed)
    else:
        tl.store(d_log_decay_ptr + chunk * CHUNK + rows, reversed_cumsum(d_decayed))


@triton.jit
def key_step_sums(
    states_ptr, d_leaving_ptr, d_out_ptr, delta_ptr, d_u_ptr, chunk, ks, k_in, d_k, d_v,
    CHUNK: tl.constexpr, KEY_STEP: tl.constexpr, BLOCK_V: tl.constexpr, HAS_BETA: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """The sums over a chunk's value columns, a block at a time, for the key columns `ks`: the gradients by the
    carried queries, by the keys decayed to the chunk's end and (with beta) by w [C, KEY_STEP]; and this step's
    part of the gradient by the chunk's carry."""
    d_q_carried = tl.zeros([CHUNK, KEY_STEP], dtype=tl.float32)
    d_k_end = tl.zeros([CHUNK, KEY_STEP], dtype=tl.float32)
    d_w = tl.zeros([CHUNK, KEY_STEP], dtype=tl.float32)
    d_carry = 0.0
    for v0 in range(0, d_v, BLOCK_V):
        vs = v0 + tl.arange(0, BLOCK_V)
        v_in = vs < d_v
        rows_v, states_at = token_tile(chunk, vs, d_v, CHUNK), state_tile(chunk, ks, vs, d_k, d_v)
        states = tl.load(states_ptr + states_at, mask=k_in[:, None] & v_in[None, :], other=0.0)
        d_leaving = tl.load(d_leaving_ptr + states_at, mask=k_in[:, None] & v_in[None, :], other=0.0)
        d_out = tl.load(d_out_ptr + rows_v, mask=v_in[None, :], other=0.0)
        delta = tl.load(delta_ptr + rows_v, mask=v_in[None, :], other=0.0)
        d_q_carried += tl.dot(d_out, tl.trans(states), input_precision=PRECISION)
        d_k_end += tl.dot(delta, tl.trans(d_leaving), input_precision=PRECISION)
        d_carry += tl.sum(tl.sum(states * d_leaving, axis=1), axis=0)
        if HAS_BETA:
            d_u = tl.load(d_u_ptr + rows_v, mask=v_in[None, :], other=0.0)
            d_w -= tl.dot(d_u, tl.trans(states), input_precision=PRECISION)
    return d_q_carried, d_k_end, d_w, d_carry


@triton.jit
def value_side_gradients(
    v_ptr, beta_ptr, ut_inverse_ptr, delta_ptr, d_out_ptr, d_u_ptr, d_v_ptr, d_t_ptr, d_beta_ptr, chunk, rows, d_v,
    CHUNK: tl.constexpr, BLOCK_V: tl.constexpr, HAS_BETA: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The sums over a chunk's value columns that take no key column: stores the gradient by v, and with beta
    those by T and beta (for `chunk_backward_ut`); returns the gradient by the output's masked attention [C, C]."""
    if HAS_BETA:
        beta = tl.load(beta_ptr + chunk * CHUNK + rows)
        ut_inverse = tl.load(ut_at(ut_inverse_ptr, chunk, CHUNK))
    d_attention = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    d_t = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    d_beta = tl.zeros([CHUNK], dtype=tl.float32)
    for v0 in range(0, d_v, BLOCK_V):
        vs = v0 + tl.arange(0, BLOCK_V)
        v_in = vs < d_v
        rows_v = token_tile(chunk, vs, d_v, CHUNK)
        d_out = tl.load(d_out_ptr + rows_v, mask=v_in[None, :], other=0.0)
        delta = tl.load(delta_ptr + rows_v, mask=v_in[None, :], other=0.0)
        d_attention += tl.dot(d_out, tl.trans(delta), input_precision=PRECISION)
        d_u = tl.load(d_u_ptr + rows_v, mask=v_in[None, :], other=0.0)
        if HAS_BETA:
            v = tl.load(v_ptr + rows_v, mask=v_in[None, :], other=0.0)
            d_v_beta = tl.dot(tl.trans(ut_inverse), d_u, input_precision=PRECISION)
            tl.store(d_v_ptr + rows_v, d_v_beta * beta[:, None], mask=v_in[None, :])
            d_t += tl.dot(d_u, tl.trans(v * beta[:, None]), input_precision=PRECISION)
            d_beta += tl.sum(d_v_beta * v, axis=1)
        else:
            tl.store(d_v_ptr + rows_v, d_u, mask=v_in[None, :])
    if HAS_BETA:
        tl.store(d_t_ptr + token_tile(chunk, rows, CHUNK, CHUNK), d_t)
        tl.store(d_beta_ptr + chunk * CHUNK + rows, d_beta)
    return d_attention


@triton.jit
def chunk_backward_ut(
    k_ptr, log_decay_ptr, beta_ptr, ut_inverse_ptr, docs_ptr, d_w_ptr, d_t_ptr, d_k_ptr, d_log_decay_ptr,
    d_beta_ptr, n_chunks, n_heads, d_k,
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, KEY_STEP: tl.constexpr, HAS_DOCS: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Through the UT transform (dL = -T^T dT T^T, strictly lower) and w's keys: adds to the gradients by k,
    beta and the decayed positions that `chunk_backward_states` left, and takes the latter back to the log
    decays. Two walks over the key columns, KEY_STEP at a time: the first sums the [C, C] products over the
    keys, the second makes the keys' gradients."""
    chunk, rows, _, _, _, pairs, carried, _, _ = chunk_program(
        log_decay_ptr, docs_ptr, n_chunks, n_heads, d_k, CHUNK, BLOCK_K, HAS_DOCS
    )
    beta = tl.load(beta_ptr + chunk * CHUNK + rows)
    ut_transposed = tl.trans(tl.load(ut_at(ut_inverse_ptr, chunk, CHUNK)))
    d_t = tl.load(d_t_ptr + token_tile(chunk, rows, CHUNK, CHUNK))
    system = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)  # (beta k) k^T
    for k0 in tl.static_range(0, BLOCK_K, KEY_STEP):
        ks = k0 + tl.arange(0, KEY_STEP)
        rows_k = token_tile(chunk, ks, d_k, CHUNK)
        k = tl.load(k_ptr + rows_k, mask=(ks < d_k)[None, :], other=0.0)
        k_beta = k * beta[:, None]
        d_w = tl.load(d_w_ptr + rows_k, mask=(ks < d_k)[None, :], other=0.0)
        d_t += tl.dot(d_w, tl.trans(k_beta * carried[:, None]), input_precision=PRECISION)
        system += tl.dot(k_beta, tl.trans(k), input_precision=PRECISION)
    d_system = tl.dot(ut_transposed, d_t, input_precision=PRECISION)
    d_system = -tl.dot(d_system, ut_transposed, input_precision=PRECISION)
    d_system = tl.where(rows[:, None] > rows[None, :], d_system, 0.0)
    d_kk = d_system * pairs
    d_decayed = tl.load(d_log_decay_ptr + chunk * CHUNK + rows) + pair_sums(d_kk * system)
    d_beta = tl.load(d_beta_ptr + chunk * CHUNK + rows)
    by_carried = tl.zeros([CHUNK], dtype=tl.float32)  # the carried decay's gradient through w, less its decay
    for k0 in tl.static_range(0, BLOCK_K, KEY_STEP):
        ks = k0 + tl.arange(0, KEY_STEP)
        k_in = ks < d_k
        rows_k = token_tile(chunk, ks, d_k, CHUNK)
        k = tl.load(k_ptr + rows_k, mask=k_in[None, :], other=0.0)
        k_beta = k * beta[:, None]
        d_keys = tl.dot(ut_transposed, tl.load(d_w_ptr + rows_k, mask=k_in[None, :], other=0.0),
                        input_precision=PRECISION)  # fmt: skip
        d_k_beta = tl.dot(d_kk, k, input_precision=PRECISION) + d_keys * carried[:, None]
        d_k_tile = tl.load(d_k_ptr + rows_k, mask=k_in[None, :], other=0.0)
        d_k_tile += tl.dot(tl.trans(d_kk), k_beta, input_precision=PRECISION) + d_k_beta * beta[:, None]
        tl.store(d_k_ptr + rows_k, d_k_tile, mask=k_in[None, :])
        d_beta += tl.sum(d_k_beta * k, axis=1)
        by_carried += tl.sum(d_keys * k_beta, axis=1)
    tl.store(d_beta_ptr + chunk * CHUNK + rows, d_beta)
    d_decayed += by_carried * carried
    tl.store(d_log_decay_ptr + chunk * CHUNK + rows, reversed_cumsum(d_decayed))


@triton.jit
def state_columns(value_block, d_k, d_v, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """A program's state columns: all keys and its block of values, with where each is in range."""
    ks = tl.arange(0, BLOCK_K)
    vs = value_block * BLOCK_V + tl.arange(0, BLOCK_V)
    return ks, vs, ks < d_k, vs < d_v


@triton.jit
def token_tile(chunk, columns, width, CHUNK: tl.constexpr):
    """The offsets of a chunk's [CHUNK, len(columns)] tile of a contiguous [..., tokens, width] tensor."""
    return (chunk * CHUNK + tl.arange(0, CHUNK)[:, None]) * width + columns[None, :]


@triton.jit
def state_tile(chunk, ks, vs, d_k, d_v):
    """The offsets of the [len(ks), len(vs)] slice of a chunk's [d_k, d_v] state."""
    return (chunk * d_k + ks[:, None]) * d_v + vs[None, :]


@triton.jit
def ut_at(ut_inverse_ptr, chunk, CHUNK: tl.constexpr):
    """The addresses of a chunk's T = (I + L)^-1 ([C, C] a chunk, row-major)."""
    return ut_inverse_ptr + token_tile(chunk, tl.arange(0, CHUNK), CHUNK, CHUNK)


@triton.jit
def pair_sums(d_pairs_by_pairs):
    """The gradient by the decayed positions (cumulative log decays) through Gamma[i, j] = exp(decayed_i -
    decayed_j), from the gradient by Gamma times Gamma: its row sums less its column sums."""
    return tl.sum(d_pairs_by_pairs, axis=1) - tl.sum(d_pairs_by_pairs, axis=0)


@triton.jit
def reversed_cumsum(x):
    """From the gradient by a cumulative sum's outputs to that by its inputs."""
    return tl.sum(x, axis=0) - tl.cumsum(x, axis=0) + x
