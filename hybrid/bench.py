"""`hybrid-bench BENCHMARK [options]`: the project's benchmarks, one subcommand each.

Each benchmark lives beside the code it measures and is imported only when run (`convert` measures the converter,
which depends on this package, not the other way round).
"""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "convert": ("convert.bench", "hybrid-convert throughput and peak memory on a synthetic checkpoint"),
    "cpu-moe": ("cpu_experts.bench", "CPU MoE operator: GB/s and TFLOP/s against the measured limits"),
    "kernels": ("gpu_layers.bench", "GPU kernels: GB/s and TFLOP/s against the measured HBM and matmul limits"),
    "decode": ("hybrid.bench_engine", "engine decode tokens/s on a converted or synthetic model, against its bound",
               "decode_main"),
    "prefill": ("hybrid.bench_engine", "engine prefill tokens/s on a converted or synthetic model", "prefill_main"),
    "load": ("hybrid.bench_load",
             "start-up from a checkpoint directory as stored: time to ready, against the read rate"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in BENCHMARKS:
        print("usage: hybrid-bench {" + ",".join(BENCHMARKS) + "} [options]", file=sys.stderr)
        for name, (_, summary, *_) in BENCHMARKS.items():
            print(f"  {name:10s} {summary}", file=sys.stderr)
        return 2
    module_name, _, *entry = BENCHMARKS[argv[0]]
    return getattr(importlib.import_module(module_name), entry[0] if entry else "main")(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
