"""`hybrid-bench BENCHMARK [options]`: the project's benchmarks, one subcommand each.

Each benchmark lives beside the code it measures and is imported only when run (`convert` measures the converter,
which depends on this package, not the other way round). decode and prefill arrive with the engine work.
"""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "convert": ("convert.bench", "hybrid-convert throughput and peak memory on a synthetic checkpoint"),
    "cpu-moe": ("cpu_experts.bench", "CPU MoE operator: GB/s and TFLOP/s against the measured limits"),
    "kernels": ("gpu_layers.bench", "GPU kernels: GB/s and TFLOP/s against the measured HBM and matmul limits"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in BENCHMARKS:
        print("usage: hybrid-bench {" + ",".join(BENCHMARKS) + "} [options]", file=sys.stderr)
        for name, (_, summary) in BENCHMARKS.items():
            print(f"  {name:10s} {summary}", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHMARKS[argv[0]][0])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
