"""Integer decode kernels (W8A8) for packed int4 experts on CPUs with VNNI (see `cpu_experts.kernels_vnni` for the
int8 ones and the LLVM IR helpers both use).

Weights: nibbles 0..15 are codes -8..7 (`cpu_experts.formats`), even column in the low nibble; scales float32 or
bfloat16 (uint16 bits, widened in registers). Activations arrive split (`prepare_int4`): x_even / x_odd int8
[T, ceil(K / 2)] (columns 2b and 2b + 1 rounded to the row's int8 grid), x_scale [T], and x_corr int32
[T, U * LANES], the correction for the nibbles' + 8 (`vpdpbusd` multiplies unsigned by signed bytes): for each
vector unit u of the row (a scale group of whole vectors, or one vector holding several 16- or 32-byte groups),
-8 times the sums of x_even + x_odd over the 4-byte lanes of its vectors. The unit's integer accumulator starts
from it, so each lane's sum is the signed dot itself and the row pays no scalar correction pass (which, one step
per group, took three times as long as the vector loop at group 32). A last group that fills no whole unit is
summed byte by byte on signed codes (`_groups_int4`).

Vectors are 64 bytes where the CPU has 512-bit VNNI, else 32. Each weight row is one call into LLVM IR that
addresses the row in place; gate and up rows of a token run in one loop, down rows four a call. Group 32 (16
bytes: Kimi-K2's INT4) puts four groups in a 64-byte vector, each four int32 lanes scaled by its own scale.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from cpu_experts.kernels import activation, scale_value
from cpu_experts.kernels_vnni import _IR, F32, FLAGS, I16, SERIAL_ROWS, has_vnni512

# Vector bytes of the int4 loops: 64 where the CPU has 512-bit VNNI (half the instructions a byte of 32-byte
# vectors, which at group 32 kept the cores from streaming at the memory's rate), else 32.
VECTOR_BYTES = 64 if has_vnni512() else 32
LANES = VECTOR_BYTES // 4  # int32 lanes of a vector: the corrections' width
DOWN_ROWS = 16  # output columns a work item of the down projection owns (its rows run four a call)
GATE_UP_ROWS = 16  # (expert, row) items of gate/up a work item owns


# ---- LLVM IR: whole-row dot products ---------------------------------------------------------------------------
# The intrinsics take whole arrays and indices, not row slices (`_IR.item_pointer`).

def _operands(g, sig, args, weights):
    """The intrinsic's row pointers: each weight row and its scales (with whether they are bfloat16 bits), the
    activation row's x_even, x_odd and corrections; and num_units, half."""
    num_arrays = 1 + max(max(w, s) for w, s, _ in weights)
    e, n, _, _, x_corr, t, num_units, half = args[num_arrays:]
    ty = dict(enumerate(sig.args))
    rows, scales = [], []
    for w_arg, s_arg, offset in weights:
        row = g.b.add(n, ir.Constant(n.type, offset))
        rows.append(g.item_pointer(ty[w_arg], args[w_arg], (e, row), ir.IntType(8)))
        is_bf16 = ty[s_arg].dtype == types.uint16
        scales.append((g.item_pointer(ty[s_arg], args[s_arg], (e, row), I16 if is_bf16 else F32), is_bf16))
    x_index = num_arrays + 2
    xe_ptr, xo_ptr = (g.item_pointer(ty[x_index + k], args[x_index + k], (t,), ir.IntType(8)) for k in range(2))
    corr = g.item_pointer(ty[x_index + 2], x_corr, (t,), ir.IntType(32))
    return rows, scales, xe_ptr, xo_ptr, corr, num_units, half


def _int4_codegen(weights: tuple[tuple[int, int, int], ...], groups_per_vector: int):
    """Intrinsic arguments: weight and scale arrays [E, N, ...], then e, n, x_even, x_odd, x_corr ([T, ...]), t,
    num_units, half. `weights`: (weight argument, scale argument, row offset) of each row dotted: row n + offset of
    expert e. Over the first `num_units` units of each row: sum_u scale(u) . (corr[u] + lo(w) . x_even + hi(w) .
    x_odd), the unit's integer lanes started from its correction vector, converted and scaled in float vectors.
    Units: with `groups_per_vector` 1, groups of `half` bytes (whole vectors); else vectors holding that many
    groups of `half` bytes each (group 32 on 32- or 64-byte vectors), each group's lanes scaled by its own scale."""
    width = VECTOR_BYTES // 4  # int32 lanes
    vi, vf = ir.VectorType(ir.IntType(32), width), ir.VectorType(F32, width)

    def codegen(context, builder, sig, args):
        g = _IR(context, builder)
        rows, scales, xe_ptr, xo_ptr, corr, num_units, half = _operands(g, sig, args, weights)
        step, lanes = ir.Constant(half.type, VECTOR_BYTES), ir.Constant(half.type, width)
        nibble, four = ir.Constant(vi, [0x0F0F0F0F] * width), ir.Constant(vi, [4] * width)
        lanes_per_group = width // groups_per_vector
        spread = ir.Constant(vi, [k // lanes_per_group for k in range(width)])

        def load(base, offset, vec=vi):
            return builder.load(builder.bitcast(builder.gep(base, [offset]), vec.as_pointer()), align=1)

        def vnni(acc, unsigned, signed):
            if width == 16:
                fn = "llvm.x86.avx512.vpdpbusd.512"
                return g.call(fn, vi, [vi, vi, vi], [acc, unsigned, signed])
            return g.vnni(acc, unsigned, signed)

        faccs = [g.zeroed(vf) for _ in rows]
        dots = [g.zeroed(vi) for _ in rows]
        with cgutils.for_range(builder, num_units) as unit_loop:
            start = load(corr, builder.mul(unit_loop.index, lanes))
            base = builder.mul(unit_loop.index, step if groups_per_vector > 1 else half)

            def block(offset, values):
                xe, xo = load(xe_ptr, offset), load(xo_ptr, offset)
                out = []
                for row, value in zip(rows, values, strict=True):
                    g.prefetch(row, offset)
                    w = load(row, offset)
                    low = vnni(value, builder.and_(w, nibble), xe)
                    out.append(vnni(low, builder.and_(builder.lshr(w, four), nibble), xo))
                return out

            if groups_per_vector > 1:  # one vector a unit: straight-line code
                sums = block(base, [start] * len(rows))
            else:
                for dot in dots:
                    builder.store(start, dot)
                with cgutils.for_range(builder, builder.sdiv(half, step)) as block_loop:
                    values = block(builder.add(base, builder.mul(block_loop.index, step)),
                                   [builder.load(dot) for dot in dots])
                    for dot, value in zip(dots, values, strict=True):
                        builder.store(value, dot)
                sums = [builder.load(dot) for dot in dots]
            for j in range(len(rows)):
                if groups_per_vector > 1:
                    first = builder.mul(unit_loop.index, ir.Constant(half.type, groups_per_vector))
                    some = g.load_scale(scales[j], first, groups_per_vector)
                    scale = builder.shuffle_vector(some, some, spread)
                else:
                    scalar = g.load_scale(scales[j], unit_loop.index)
                    scale = builder.shuffle_vector(builder.insert_element(ir.Constant(vf, None), scalar,
                                                                          ir.Constant(ir.IntType(32), 0)),
                                                   ir.Constant(vf, None), ir.Constant(vi, [0] * width))
                fma = g.call(f"llvm.fma.v{width}f32", vf, [vf, vf, vf], [builder.sitofp(sums[j], vf), scale,
                                                                         builder.load(faccs[j])])
                builder.store(fma, faccs[j])
        totals = [_sum_lanes(builder, builder.load(acc), vf) for acc in faccs]
        return totals[0] if len(totals) == 1 else context.make_tuple(builder, sig.return_type, totals)
    return codegen


def _sum_lanes(builder, vec, vf):
    """The float lanes' sum as a tree of halves, written out: the ordered reduction is a chain of dependent adds a
    row, and a `reassoc` one may be ordered differently where rows are reduced together (four-row calls), so a
    row's dot would depend on its neighbours."""
    width = vf.count
    while width > 1:
        width //= 2
        low = builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(ir.IntType(32), width), list(range(width))))
        high = builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(ir.IntType(32), width),
                                                            list(range(width, 2 * width))))
        vec = builder.fadd(low, high)
    return builder.extract_element(vec, ir.Constant(ir.IntType(32), 0))


ONE_ROW = ((0, 1, 0),)
GATE_UP = ((0, 2, 0), (1, 3, 0))  # gate, up, gate_s, up_s
FOUR_ROWS = tuple((0, 1, k) for k in range(4))


@intrinsic
def _row_dot(typingctx, w, s, e, n, x_even, x_odd, x_corr, t, num_units, half):
    """Row w[e, n] (scales s[e, n]) against activation row t: the corrected, scaled dot over its first num_units
    units (`_int4_codegen`); `half` 16 takes the group-32 loop."""
    sig = types.float32(w, s, e, n, x_even, x_odd, x_corr, t, num_units, half)
    return sig, _dispatch(ONE_ROW)


@intrinsic
def _gate_up_dots(typingctx, gate, up, gate_s, up_s, e, n, x_even, x_odd, x_corr, t, num_units, half):
    """`_row_dot` of gate[e, n] and up[e, n] in one loop."""
    sig = types.UniTuple(types.float32, 2)(gate, up, gate_s, up_s, e, n, x_even, x_odd, x_corr, t, num_units, half)
    return sig, _dispatch(GATE_UP)


@intrinsic
def _four_dots(typingctx, w, s, e, n, x_even, x_odd, x_corr, t, num_units, half):
    """`_row_dot` of rows n..n + 3 of w[e] in one loop."""
    sig = types.UniTuple(types.float32, 4)(w, s, e, n, x_even, x_odd, x_corr, t, num_units, half)
    return sig, _dispatch(FOUR_ROWS)


def _dispatch(weights):
    """One function over the group sizes: vectors of several groups where a group is shorter than a vector
    (half 16, and 32 on 64-byte vectors), whole-vector groups otherwise (a branch per row call)."""
    multi = {half: _int4_codegen(weights, VECTOR_BYTES // half) for half in (16, 32) if half < VECTOR_BYTES}
    whole = _int4_codegen(weights, 1)

    def codegen(context, builder, sig, args):
        half = args[-1]
        results = []
        end = builder.append_basic_block("int4.end")
        cases = [(size, builder.append_basic_block(f"int4.half{size}")) for size in multi]
        otherwise = builder.append_basic_block("int4.whole")
        switch = builder.switch(half, otherwise)
        for size, block in cases:
            switch.add_case(ir.Constant(half.type, size), block)
            builder.position_at_end(block)
            results.append((multi[size](context, builder, sig, args), builder.block))
            builder.branch(end)
        builder.position_at_end(otherwise)
        results.append((whole(context, builder, sig, args), builder.block))
        builder.branch(end)
        builder.position_at_end(end)
        phi = builder.phi(results[0][0].type)
        for value, block in results:
            phi.add_incoming(value, block)
        return phi
    return codegen


# ---- row dot products ------------------------------------------------------------------------------------------

@njit(fastmath=True, cache=True)
def vector_units(num_bytes, half):
    """(units, groups) the vector loops cover of a row of `num_bytes`: groups of whole vectors (`half`, the group's
    bytes, a multiple of VECTOR_BYTES), or vectors of several 16- or 32-byte groups; `_groups_int4` takes the
    groups after them."""
    if half % VECTOR_BYTES == 0:
        return num_bytes // half, num_bytes // half
    if (half == 16 or half == 32) and half < VECTOR_BYTES:
        return num_bytes // VECTOR_BYTES, num_bytes // VECTOR_BYTES * (VECTOR_BYTES // half)
    return 0, 0


@njit(fastmath=True, cache=True)
def _groups_int4(w, s, e, n, x_even, x_odd, t, group, first):
    """Row w[e, n] . x[t] over groups `first`.. one byte at a time, on signed codes (a last group that fills no
    whole vector unit). Indexed in place, like the intrinsics (see above: no slices)."""
    half = group // 2  # group is even, so a group is whole bytes; x_odd is zero past an odd K
    num_bytes = w.shape[2]
    acc = np.float32(0.0)
    for g in range(first, s.shape[2]):
        total = np.int64(0)
        for b in range(g * half, min(g * half + half, num_bytes)):
            byte = np.int64(w[e, n, b])
            total += ((byte & 15) - 8) * np.int64(x_even[t, b]) + ((byte >> 4) - 8) * np.int64(x_odd[t, b])
        acc += np.float32(total) * scale_value(s[e, n, g])
    return acc


@njit(fastmath=True, cache=True)
def row_layout(num_bytes, group):
    """(units, full groups, half) of rows of `num_bytes` int4 bytes with this group: the row calls' loop bounds,
    computed once per call (integer divisions cost more than a short row's loop control)."""
    half = group // 2
    units, full = vector_units(num_bytes, half)
    return units, full, half


# ---- activations -----------------------------------------------------------------------------------------------

def num_corrections(num_bytes: int, group: int) -> int:
    """x_corr's width for rows of `num_bytes` int4 bytes: LANES per vector unit (at least 1, for empty shapes)."""
    return max(1, vector_units(num_bytes, group // 2)[0]) * LANES


@njit(fastmath=True, cache=True)
def quantize_int4_row(x, x_even, x_odd, x_corr, group):
    """x float32 [K] -> x_even / x_odd int8 [ceil(K / 2)] (columns 2b and 2b + 1 rounded, x_odd zero past an odd
    K) and x_corr (see the module); returns the row's scale."""
    cols = x.shape[0]
    amax = np.float32(0.0)
    for j in range(cols):
        amax = max(amax, abs(x[j]))
    inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
    for b in range(x_even.shape[0]):
        x_even[b] = np.int8(np.rint(x[2 * b] * inv))
        x_odd[b] = np.int8(np.rint(x[2 * b + 1] * inv)) if 2 * b + 1 < cols else np.int8(0)
    half = group // 2
    units, _ = vector_units(x_even.shape[0], half)
    unit_bytes = VECTOR_BYTES if half < VECTOR_BYTES else half
    for u in range(units):
        for lane in range(LANES):
            total = 0
            for block in range(u * unit_bytes, (u + 1) * unit_bytes, VECTOR_BYTES):
                for b in range(block + 4 * lane, block + 4 * lane + 4):
                    total += np.int32(x_even[b]) + np.int32(x_odd[b])
            x_corr[u * LANES + lane] = -8 * total
    return amax / np.float32(127.0)


@njit(**FLAGS)
def prepare_int4(x, group, x_even, x_odd, x_scale, x_corr):
    """x float32 [T, K] -> x_even / x_odd int8 [T, ceil(K / 2)], x_scale [T], x_corr int32 [T, U * 8]."""
    if x.shape[0] < SERIAL_ROWS:
        for t in range(x.shape[0]):
            x_scale[t] = quantize_int4_row(x[t], x_even[t], x_odd[t], x_corr[t], group)
    else:
        for t in prange(x.shape[0]):
            x_scale[t] = quantize_int4_row(x[t], x_even[t], x_odd[t], x_corr[t], group)


# ---- one partition of one layer, in one call -------------------------------------------------------------------

@njit(**FLAGS)
def decode_int4(x, experts, offsets, pair_token, pair_weight, gate, gate_s, up, up_s, down, down_s, group_h,
                group_i, epilogue, out):
    """out[T, H] += this partition's experts on x float32 [T, H] (`kernels_vnni.decode_int8` for packed int4)."""
    num_tokens, num_pairs, rows = x.shape[0], pair_token.shape[0], gate.shape[1]
    x_even = np.empty((num_tokens, gate.shape[2]), dtype=np.int8)  # gate rows: ceil(H / 2) bytes
    x_odd = np.empty_like(x_even)
    x_scale = np.empty(num_tokens, dtype=np.float32)
    x_corr = np.empty((num_tokens, max(1, vector_units(gate.shape[2], group_h // 2)[0]) * LANES), dtype=np.int32)
    prepare_int4(x, group_h, x_even, x_odd, x_scale, x_corr)
    act = np.empty((num_pairs, rows), dtype=np.float32)
    num_items = experts.shape[0] * rows
    for chunk in prange(-(-num_items // GATE_UP_ROWS)):
        gate_up_rows_int4(chunk * GATE_UP_ROWS, min(chunk * GATE_UP_ROWS + GATE_UP_ROWS, num_items), experts,
                          offsets, pair_token, gate, gate_s, up, up_s, x_even, x_odd, x_corr, x_scale, group_h,
                          epilogue, act)
    a_even = np.empty((num_pairs, down.shape[2]), dtype=np.int8)  # down rows: ceil(Ip / 2) bytes
    a_odd = np.empty_like(a_even)
    a_scale = np.empty(num_pairs, dtype=np.float32)
    a_corr = np.empty((num_pairs, max(1, vector_units(down.shape[2], group_i // 2)[0]) * LANES), dtype=np.int32)
    prepare_int4(act, group_i, a_even, a_odd, a_scale, a_corr)
    num_hidden = down.shape[1]
    for block in prange(-(-num_hidden // DOWN_ROWS)):
        down_rows_int4(block * DOWN_ROWS, min(block * DOWN_ROWS + DOWN_ROWS, num_hidden), experts, offsets,
                       pair_token, pair_weight, down, down_s, a_even, a_odd, a_corr, a_scale, group_i, out)


# The bodies of decode_int4's two loops, shared with `cpu_experts.decode_pool` (which splits the same items over its
# own threads), so the two compute every output element with the same sums in the same order.

@njit(fastmath=True, cache=True, inline="always")
def gate_up_rows_int4(lo, hi, experts, offsets, pair_token, gate, gate_s, up, up_s, x_even, x_odd, x_corr, x_scale,
                      group_h, epilogue, act):
    """Work items lo..hi, item r = (routed expert u, row i) = divmod(r, I): act[p, i] = activation(gate . x_t,
    up . x_t) (`kernels.activation`: silu(g) * v or the layer's epilogue) for u's pairs p. The intrinsics are
    called here directly: through a numba-level helper, every row paid for the helper's array copies (reference
    counts) and the tail's call, half again its loop's time."""
    rows = gate.shape[1]
    units, full, half = row_layout(gate.shape[2], group_h)
    has_tail = full < gate_s.shape[2]
    r = lo
    while r < hi:
        u = r // rows
        first = r - u * rows
        last = min(rows, first + hi - r)
        e = experts[u]
        for i in range(first, last):
            for p in range(offsets[u], offsets[u + 1]):
                t = pair_token[p]
                g, v = _gate_up_dots(gate, up, gate_s, up_s, e, i, x_even, x_odd, x_corr, t, units, half)
                if has_tail:
                    g += _groups_int4(gate, gate_s, e, i, x_even, x_odd, t, group_h, full)
                    v += _groups_int4(up, up_s, e, i, x_even, x_odd, t, group_h, full)
                act[p, i] = activation(g * x_scale[t], v * x_scale[t], epilogue, e, i, True)
        r += last - first


@njit(fastmath=True, cache=True, inline="always")
def down_rows_int4(lo, hi, experts, offsets, pair_token, pair_weight, down, down_s, a_even, a_odd, a_corr, a_scale,
                   group_i, out):
    """Output columns lo..hi: out[t, h] += w * (down[e, h] . act_p) over every routed expert e and its pairs p,
    four rows of down a call (one pass over the activation for four weight rows). a_even / a_odd may be wider than
    down's rows (the pool's scratch): only the first columns are read."""
    units, full, half = row_layout(down.shape[2], group_i)
    has_tail = full < down_s.shape[2]
    four_end = lo + (hi - lo) // 4 * 4
    for u in range(experts.shape[0]):
        e = experts[u]
        for p in range(offsets[u], offsets[u + 1]):
            t, weight = pair_token[p], pair_weight[p] * a_scale[p]
            for h in range(lo, four_end, 4):
                d0, d1, d2, d3 = _four_dots(down, down_s, e, h, a_even, a_odd, a_corr, p, units, half)
                if has_tail:
                    d0 += _groups_int4(down, down_s, e, h, a_even, a_odd, p, group_i, full)
                    d1 += _groups_int4(down, down_s, e, h + 1, a_even, a_odd, p, group_i, full)
                    d2 += _groups_int4(down, down_s, e, h + 2, a_even, a_odd, p, group_i, full)
                    d3 += _groups_int4(down, down_s, e, h + 3, a_even, a_odd, p, group_i, full)
                out[t, h] += weight * d0
                out[t, h + 1] += weight * d1
                out[t, h + 2] += weight * d2
                out[t, h + 3] += weight * d3
            for h in range(four_end, hi):
                d = _row_dot(down, down_s, e, h, a_even, a_odd, a_corr, p, units, half)
                if has_tail:
                    d += _groups_int4(down, down_s, e, h, a_even, a_odd, p, group_i, full)
                out[t, h] += weight * d
