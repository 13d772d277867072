"""`hybrid-bench cpu-moe`: the CPU MoE operator against the machine's limits, measured in the same run.

Random quantized weights (the kernels' speed does not depend on the values) for enough layers that the weights
are many times the last-level cache, uniform random routing, calls rotating over the layers so no call finds its
experts in cache. Per (dtype, tokens, path): microseconds per call, GB/s of expert weights read (each routed expert
read once per call), that rate over the memory read bandwidth measured by a large read-only pass, and TFLOP/s.
Paths: `kernel` is the operator as it runs (decode kernels below the prefill threshold, matmul above);
`matmul` forces the PyTorch prefill path, the simple alternative.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import torch
from numba import njit, prange

from cpu_experts import memory, topology
from cpu_experts.expert_file import ALLOWED_SCALES, ExpertLayerSpec
from cpu_experts.operator import CpuMoE
from cpu_experts.packed import PackedLayer, PartitionWeights

# shape -> (experts, hidden, intermediate, top-k)
SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8), "qwen3-235b-a22b": (128, 4096, 1536, 8),
          "deepseek-v3": (256, 7168, 2048, 8), "kimi-k2.5": (384, 7168, 2048, 8), "small": (32, 512, 256, 4)}
GROUPS = {"int8": 0, "int4": 128, "int4-g32": 32, "fp8": 128, "mxfp4": 32, "nvfp4": 16}
# --dtype spellings that are not an expert dtype's own name: (dtype, scale dtype)
VARIANTS = {"int4-g32": ("int4", "bfloat16")}  # Kimi-K2's INT4 as published: group 32, bfloat16 scales
# Scale bytes of the float formats, for weights of a checkpoint's size (|w| < 0.1, as the int scales below give):
# random bits would hold NaNs, and large weights make activations whose silu is subnormal, which slows any kernel
# down. E8M0 2^-11 .. 2^-6; e4m3 0.125 .. 1.875 (times tensor scales below 1e-3).
SCALE_BITS = {"e8m0": (116, 122), "e4m3": (0x28, 0x40)}
ROW_SECONDS = 10.0


def last_level_cache_bytes() -> int:
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        sizes.append(int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}.get(text[-1], 1) if text[-1].isalpha()
                     else int(text))
    return max(sizes, default=32 << 20)


@njit(parallel=True, fastmath=True, nogil=True, cache=True)
def _read_all(data):
    total = 0
    for i in prange(data.shape[0]):
        total += data[i]
    return total


class ReadBandwidth:
    """Bytes per second of a parallel read-only pass over `nbytes` of the same huge-page memory as the experts,
    the median of `repeats` passes. The device host's bandwidth drifts by a third within minutes (other tenants),
    so every row of the table is measured against passes made just before and just after it.

    `cpus`: read by one thread pinned on each of them (the decode pool's way), each its contiguous share, timed from
    a common start to the last thread's end; None: by numba's OpenMP team (the kernels' pool)."""

    def __init__(self, nbytes: int, cpus: tuple[int, ...] | None = None):
        self.data = memory.empty((nbytes // 8,), np.int64)
        self.data.fill(1)
        self.cpus = cpus
        self._pass()

    def __call__(self, repeats: int = 5) -> float:
        return self.data.nbytes / statistics.median(self._pass() for _ in range(repeats))

    def _pass(self) -> float:
        if self.cpus is None:
            return _timed(lambda: _read_all(self.data))
        shares = np.array_split(self.data, len(self.cpus))
        start = threading.Barrier(len(self.cpus) + 1)
        ends = [0.0] * len(self.cpus)

        def read(i: int) -> None:
            topology.pin_current_thread([self.cpus[i]])
            start.wait()
            _sum(shares[i])
            ends[i] = time.perf_counter()

        threads = [threading.Thread(target=read, args=(i,)) for i in range(len(self.cpus))]
        for thread in threads:
            thread.start()
        start.wait()
        began = time.perf_counter()
        for thread in threads:
            thread.join()
        return max(ends) - began


@njit(fastmath=True, nogil=True, cache=True)
def _sum(data):
    total = 0
    for i in range(data.shape[0]):
        total += data[i]
    return total


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def random_layer(shape: str, dtype: str, seed: int) -> PackedLayer:
    num_experts, hidden, inter, _ = SHAPES[shape]
    base, scale_dtype = VARIANTS[dtype] if dtype in VARIANTS else (dtype, ALLOWED_SCALES[dtype][0])
    spec = ExpertLayerSpec(num_experts, hidden, inter, base, GROUPS[dtype], scale_dtype)
    rng = np.random.default_rng(seed)
    block = rng.integers(0, 256, size=1 << 24, dtype=np.uint8)  # tiled: generating gigabytes would dominate
    arrays = {}
    for name, (dims, tdtype) in spec.tensor_shapes().items():
        if tdtype == torch.float32:
            arrays[name] = (rng.random(dims, dtype=np.float32) * 1e-3)
        elif tdtype == torch.bfloat16 and name.endswith("scales"):  # random bits would include subnormals
            arrays[name] = torch.full(dims, 1e-3, dtype=tdtype).view(torch.uint16).numpy()
        elif name.endswith(".scales") and spec.scale_dtype in SCALE_BITS:
            arrays[name] = rng.integers(*SCALE_BITS[spec.scale_dtype], size=dims, dtype=np.uint8)
        else:
            array = memory.empty_tensor(dims, tdtype).numpy()
            flat = array.reshape(-1).view(np.uint8)
            for start in range(0, flat.size, block.size):
                flat[start:start + block.size] = block[:flat.size - start]
            arrays[name] = array
    part = PartitionWeights(0, inter, arrays["gate.weight"], arrays["up.weight"], arrays["down.weight"],
                            arrays.get("gate.scales"), arrays.get("up.scales"), arrays.get("down.scales"),
                            arrays.get("gate.tensor_scale"), arrays.get("up.tensor_scale"),
                            arrays.get("down.tensor_scale"))
    return PackedLayer(spec, [part])


def measure(layers: list[PackedLayer], tokens: int, path: str, calls: int, seed: int) -> dict:
    spec = layers[0].spec
    top_k = SHAPES_BY_SPEC[(spec.num_experts, spec.hidden_size)]
    threshold = None if path == "kernel" else 1  # None: the operator's own per-dtype threshold
    ops = [CpuMoE(layer, prefill_min_tokens=threshold) for layer in layers]
    gen = torch.Generator().manual_seed(seed)
    times, read = [], []
    started = time.perf_counter()
    for call in range(calls + 2):
        if call > 4 and time.perf_counter() - started > ROW_SECONDS:
            break  # large prefill calls: a few are enough
        ids = torch.stack([torch.randperm(spec.num_experts, generator=gen)[:top_k] for _ in range(tokens)])
        x = torch.randn(tokens, spec.hidden_size, generator=gen).bfloat16()
        w = torch.rand(tokens, top_k, generator=gen)
        seconds = _timed(lambda: ops[call % len(ops)](x, ids, w))  # noqa: B023 (called at once)
        if call >= 2:  # the first calls compile and warm up
            times.append(seconds)
            read.append(len(torch.unique(ids)) * layers[0].expert_bytes())
    t = statistics.median(times)
    flops = 2 * tokens * top_k * 3 * spec.hidden_size * spec.intermediate_size
    return {"seconds": t, "bytes": statistics.median(read), "gb_s": statistics.median(read) / t / 1e9,
            "tflop_s": flops / t / 1e12}


SHAPES_BY_SPEC = {(e, h): k for e, h, _, k in SHAPES.values()}


def run(args) -> list[dict]:
    llc = last_level_cache_bytes()
    bandwidth = ReadBandwidth(max(8 * llc, 1 << 30))
    rows = []
    for dtype in args.dtype.split(","):
        probe = random_layer(args.shape, dtype, 0)
        num_layers = args.layers or max(2, -(-8 * llc // probe.nbytes))
        layers = [probe] + [random_layer(args.shape, dtype, i) for i in range(1, num_layers)]
        for tokens in (int(t) for t in args.tokens.split(",")):
            for path in args.paths.split(","):
                before = bandwidth()
                m = measure(layers, tokens, path, args.calls, seed=tokens)
                read_bw = (before + bandwidth()) / 2
                rows.append({"shape": args.shape, "dtype": dtype, "tokens": tokens, "path": path,
                             "layers": num_layers, "threads": torch.get_num_threads(),
                             "us_per_call": m["seconds"] * 1e6, "weights_gb_s": m["gb_s"],
                             "read_bandwidth_gb_s": read_bw / 1e9,
                             "fraction_of_bandwidth": m["gb_s"] * 1e9 / read_bw,
                             "tflop_s": m["tflop_s"], "llc_mib": llc / 2**20})
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hybrid-bench cpu-moe", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--dtype", default="int8",
                        help="comma-separated: int8,int4,int4-g32 (group 32, bf16 scales),fp8,mxfp4,nvfp4")
    parser.add_argument("--tokens", default="1,4,32,512,2048", help="comma-separated token counts")
    parser.add_argument("--paths", default="kernel", help="comma-separated: kernel (as it runs), matmul")
    parser.add_argument("--layers", type=int, default=0, help="layers to rotate over (default: 8x the LLC)")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch/numba threads (default: all)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    topology.set_worker_spin()
    if args.threads:
        torch.set_num_threads(args.threads)
        import numba

        numba.set_num_threads(args.threads)
    rows = run(args)
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    r0 = rows[0]
    print(f"{args.shape}: {r0['layers']} layers, LLC {r0['llc_mib']:.0f} MiB, {r0['threads']} threads, "
          f"{os.cpu_count()} CPUs")
    print("dtype  tokens  path     us/call   weights GB/s  read GB/s  of-bandwidth  TFLOP/s")
    for r in rows:
        print(f"{r['dtype']:5s}  {r['tokens']:6d}  {r['path']:7s}  {r['us_per_call']:8.0f}  {r['weights_gb_s']:12.1f}"
              f"  {r['read_bandwidth_gb_s']:9.1f}  {r['fraction_of_bandwidth']:12.1%}  {r['tflop_s']:7.3f}")
    return 0
