"""`hybrid-bench kernels`: every GPU kernel against the GPU's limits, measured in the same run.

The ceilings come first: HBM bandwidth from a large device-to-device copy (bytes read plus written), matrix
throughput from a large bf16 matmul (and fp8 where `torch._scaled_mm` runs). Then each kernel module's
`bench_cases()` -> [(name, run_once, bytes_moved, flops[, baseline])] is captured in a CUDA graph where it can be
(as the runtime replays decode) and timed with `triton.testing.do_bench` (median, the L2 flushed before every
repetition), and reported as GB/s and TFLOP/s, each over its ceiling (a case named "fp8" over the fp8 matmul rate); the
larger of the two fractions is how close the kernel is to its roofline. A case with a baseline (the simple
alternative, e.g. PyTorch SDPA on a contiguous copy of the KV) also reports our speed-up over it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys

import torch

MODULES = ("norm", "activation", "rotary", "routing", "kv_cache", "attention", "mla", "mla_sparse", "mla_absorb",
           "dsa", "fused_moe", "w8a8_moe", "linear", "delta_net")


def _median_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def hbm_bandwidth(nbytes: int = 4 << 30) -> float:
    """Bytes per second of a device-to-device copy, counting the bytes read and the bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    return 2 * src.numel() / (_median_ms(lambda: dst.copy_(src)) / 1e3)


def matmul_flops(dtype: torch.dtype = torch.bfloat16, n: int = 8192) -> float:
    """FLOP/s of an n x n x n matmul on random data (zeros run faster)."""
    a = torch.randn(n, n, device="cuda").to(dtype)
    b = torch.randn(n, n, device="cuda").to(dtype)
    if dtype == torch.float8_e4m3fn:
        one = torch.ones((), device="cuda")
        run = lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
    else:
        run = lambda: a @ b  # noqa: E731
    return 2 * n**3 / (_median_ms(run) / 1e3)


def as_graph(run):
    """`run` captured in a CUDA graph (what the runtime replays at decode), or None where it cannot be captured
    (a host sync inside); without one, small cases measure Python's launch time, not the GPU's."""
    run()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            run()
    except RuntimeError:
        torch.cuda.synchronize()
        return None
    return graph.replay


def measure(case, ceilings: dict) -> dict:
    name, run, nbytes, flops, *rest = case
    replay = as_graph(run)
    ms = _median_ms(replay or run)
    row = {"kernel": name, "us": ms * 1e3, "gb_s": nbytes / ms / 1e6, "tflop_s": flops / ms / 1e9,
           "timing": "graph" if replay else "eager"}
    row["of_bandwidth"] = row["gb_s"] * 1e9 / ceilings["hbm_bytes_s"]
    is_fp8 = "fp8" in name and "fp8_flop_s" in ceilings  # fp8 x fp8 matmuls: against the fp8 rate
    row["of_matmul"] = row["tflop_s"] * 1e12 / ceilings["fp8_flop_s" if is_fp8 else "bf16_flop_s"]
    row["of_roofline"] = max(row["of_bandwidth"], row["of_matmul"])
    if rest and rest[0] is not None:
        row["baseline_us"] = _median_ms(as_graph(rest[0]) or rest[0]) * 1e3
        row["speedup"] = row["baseline_us"] / row["us"]
    return row


def run(modules: list[str], name_filter: str) -> tuple[dict, list[dict]]:
    ceilings = {"device": torch.cuda.get_device_name(), "hbm_bytes_s": hbm_bandwidth(),
                "bf16_flop_s": matmul_flops()}
    with contextlib.suppress(RuntimeError, AttributeError):  # no fp8 matmul on this GPU or build
        ceilings["fp8_flop_s"] = matmul_flops(torch.float8_e4m3fn)
    rows = []
    for module_name in modules:
        module = importlib.import_module(f"gpu_layers.{module_name}")
        for case in module.bench_cases():
            if name_filter in case[0]:
                rows.append({"module": module_name, **measure(case, ceilings)})
                torch.cuda.empty_cache()
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # progress, and a record if a case fails
    return ceilings, rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hybrid-bench kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--modules", default=",".join(MODULES), help="comma-separated gpu_layers modules")
    parser.add_argument("--filter", default="", help="only cases whose name contains this")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("hybrid-bench kernels needs a CUDA GPU")
        return 2
    ceilings, rows = run(args.modules.split(","), args.filter)
    if args.json:
        print(json.dumps({"ceilings": ceilings}))
        for row in rows:
            print(json.dumps(row))
        return 0
    fp8 = f", fp8 matmul {ceilings['fp8_flop_s'] / 1e12:.0f} TFLOP/s" if "fp8_flop_s" in ceilings else ""
    print(f"{ceilings['device']}: copy {ceilings['hbm_bytes_s'] / 1e9:.0f} GB/s, bf16 matmul "
          f"{ceilings['bf16_flop_s'] / 1e12:.0f} TFLOP/s{fp8}")
    print(f"{'kernel':58s} {'us':>9s} {'GB/s':>8s} {'TFLOP/s':>8s} {'of BW':>6s} {'of MM':>6s} {'vs base':>8s} timing")
    for r in rows:
        speedup = f"{r['speedup']:7.2f}x" if "speedup" in r else ""
        print(f"{r['kernel'][:58]:58s} {r['us']:9.1f} {r['gb_s']:8.0f} {r['tflop_s']:8.1f} {r['of_bandwidth']:6.0%} "
              f"{r['of_matmul']:6.0%} {speedup:>8s} {r['timing']}")
    return 0
