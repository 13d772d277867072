"""A/B of the FP4 decode kernels in one process (issue 19): the factored lookups (twice the e2m1 value, the chunk's
products times the group's factors: the kernels before the folded scale) against the scaled ones (value * scale
from the lookup, `kernels_fp4_ir.scaled_tables`), on DeepSeek-V3's shape (top-8, one token), every call on fresh
random experts of alternating layers so that it reads them from DRAM, the read bandwidth measured around each
format as `hybrid-bench cpu-moe` does. The loops are the operator's (`kernels_fp4._loops_*`: 16 gate/up items or
16 down columns a work item, four down rows a call; tensor scales, all ones for MXFP4).

    python3 -m cpu_experts.probe_float_decode [--calls 30] [--layers 2] [--formats mxfp4,nvfp4] [--shape ...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from numba import njit, prange
from numba.extending import intrinsic

from cpu_experts import kernels_fp4_ir as fp4_ir
from cpu_experts.bench import SHAPES, ReadBandwidth, last_level_cache_bytes, random_layer
from cpu_experts.kernels_fp4 import DOWN_ROWS, GATE_UP_ROWS, MX_FACTORS, NV_FACTORS, _store_act, act_bf16, split_bf16


def _dots(is_mx: bool, is_scaled: bool):
    """The two-row (gate, up) and four-row (down) dot intrinsics of one variant."""
    def two(typingctx, w0, s0, w1, s1, e, n, table, x_even, x_odd, t):
        return (fp4_ir._signature(2)(w0, s0, w1, s1, e, n, table, x_even, x_odd, t),
                fp4_ir._fp4_codegen(fp4_ir.TWO_ROWS, is_mx, is_scaled=is_scaled))

    def four(typingctx, w, s, e, n, table, x_even, x_odd, t):
        return (fp4_ir._signature(4)(w, s, e, n, table, x_even, x_odd, t),
                fp4_ir._fp4_codegen(fp4_ir.FOUR_ROWS, is_mx, is_scaled=is_scaled))
    return intrinsic(two), intrinsic(four)


def _decoder(is_mx: bool, is_scaled: bool):
    dot2, dot4 = _dots(is_mx, is_scaled)
    table = MX_FACTORS if is_mx else NV_FACTORS

    @njit(parallel=True, fastmath=True, nogil=True, error_model="numpy")
    def decode(experts, weights, gate, gate_s, gate_ts, up, up_s, up_ts, down, down_s, down_ts, x_even, x_odd,
               act_even, act_odd, out):
        """out[H] += sum_u weights[u] * expert experts[u] on one token (x split); I and H multiples of 16."""
        rows = gate.shape[1]
        for c in prange(experts.shape[0] * rows // GATE_UP_ROWS):
            for r in range(c * GATE_UP_ROWS, c * GATE_UP_ROWS + GATE_UP_ROWS):
                u = r // rows
                i, e = r - u * rows, experts[u]
                g, v = dot2(gate, gate_s, up, up_s, e, i, table, x_even, x_odd, 0)
                _store_act(act_even, act_odd, u, i, rows, act_bf16(g * gate_ts[e], v * up_ts[e], None, e, i))
        for c in prange(down.shape[1] // DOWN_ROWS):
            for u in range(experts.shape[0]):
                e, weight = experts[u], weights[u] * down_ts[experts[u]]
                for h in range(c * DOWN_ROWS, c * DOWN_ROWS + DOWN_ROWS, 4):
                    d0, d1, d2, d3 = dot4(down, down_s, e, h, table, act_even, act_odd, u)
                    out[h] += weight * d0
                    out[h + 1] += weight * d1
                    out[h + 2] += weight * d2
                    out[h + 3] += weight * d3
    return decode


def tensor_scales(part, role: str) -> tuple[np.ndarray]:
    """(role's tensor scales [E],): NVFP4's, ones for MXFP4."""
    scales = getattr(part, f"{role}_tensor_scale")
    return (np.ones(part.gate.shape[0], np.float32) if scales is None else scales,)


def probe(shape: str, fmt: str, calls: int, num_layers: int, bandwidth: ReadBandwidth) -> None:
    num_experts, hidden, inter, top_k = SHAPES[shape]
    layers = [random_layer(shape, fmt, seed) for seed in range(num_layers)]
    expert_bytes = layers[0].expert_bytes()
    variants = {"factored": _decoder(fmt == "mxfp4", False), "scaled": _decoder(fmt == "mxfp4", True)}
    rng = np.random.default_rng(0)
    x_even, x_odd = np.empty((1, hidden // 2), np.float32), np.empty((1, hidden // 2), np.float32)
    split_bf16(rng.standard_normal((1, hidden)).astype(np.float32), x_even, x_odd)
    act_even, act_odd = np.empty((top_k, inter // 2), np.float32), np.empty((top_k, inter // 2), np.float32)
    times = {name: [] for name in variants}
    worst = 0.0
    before = bandwidth()
    for call in range(calls + 2):
        experts = np.sort(rng.choice(num_experts, top_k, replace=False)).astype(np.int64)
        weights = rng.random(top_k).astype(np.float32)
        part = layers[call % num_layers].partitions[0]
        order = list(variants) if call % 2 else list(variants)[::-1]  # neither variant always second
        outs = {}
        for name in order:
            out = np.zeros(hidden, np.float32)
            start = time.perf_counter()
            variants[name](experts, weights, part.gate, part.gate_scales, *tensor_scales(part, "gate"), part.up,
                           part.up_scales, *tensor_scales(part, "up"), part.down, part.down_scales,
                           *tensor_scales(part, "down"), x_even, x_odd, act_even, act_odd, out)
            if call >= 2:  # the first calls compile and warm up
                times[name].append(time.perf_counter() - start)
            outs[name] = out
        scale = float(np.abs(outs["factored"]).max())
        worst = max(worst, float(np.abs(outs["factored"] - outs["scaled"]).max()) / scale)
    read = (before + bandwidth()) / 2
    for name, ts in times.items():
        t = statistics.median(ts)
        rate = top_k * expert_bytes / t
        print(f"{fmt:6s} {name:9s} {t * 1e6:9.0f} us (min {min(ts) * 1e6:.0f})  {rate / 1e9:6.1f} GB/s  of read "
              f"{read / 1e9:6.1f} GB/s: {rate / read:6.1%}")
    print(f"{fmt:6s} max |factored - scaled| / max |out|: {worst:.2e} (float32 summation order: ~1e-6)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--formats", default="mxfp4,nvfp4")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="deepseek-v3")
    args = parser.parse_args(argv)
    bandwidth = ReadBandwidth(max(8 * last_level_cache_bytes(), 1 << 30))
    print(f"decode mode: {fp4_ir.decode_mode()}")
    for fmt in args.formats.split(","):
        probe(args.shape, fmt, args.calls, args.layers, bandwidth)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
