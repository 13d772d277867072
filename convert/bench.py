"""`hybrid-bench convert`: conversion throughput and peak memory on a synthetic checkpoint of a released shape.

Each conversion runs in a child process that reports its own peak RSS (VmHWM); a baseline child imports the
same modules and plans the same conversion without writing anything, so `peak - baseline` is what converting
costs. The limit for throughput is measured in the same run: the rate at which the source files stream from the
page cache. Prints one row per expert dtype (or JSON lines with --json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hybrid import bench_load
from hybrid.synthetic import SHAPES, write_synthetic_checkpoint

MiB = 2**20
CHILD = """
import sys
from pathlib import Path

def vm_hwm():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

mode, args = sys.argv[1], sys.argv[2:]
from convert.cli import main
from convert.plan import build_plan
plan = build_plan(args[0])
rc = main(args) if mode == "convert" else 0
largest = max(info.nbytes for file in set(plan.ckpt.files.values()) for info in file.tensors.values())
print("RESULT", rc, vm_hwm(), largest)
"""


def _child(mode: str, args: list[str]) -> tuple[float, int, int]:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, mode, *args], capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT")), None)
    if line is None or line.split()[1] != "0":
        raise RuntimeError(f"conversion child failed:\n{out.stdout}\n{out.stderr}")
    _, _, peak, largest = line.split()
    return seconds, int(peak), int(largest)


def read_rate(directory: Path) -> float:
    """Bytes per second of reading every safetensors file in `directory` (warm page cache, one pass)."""
    return bench_load.read_rate(sorted(directory.glob("*.safetensors")))


def run(args) -> list[dict]:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="hybrid-bench-convert-"))
    src = workdir / f"{args.synthetic}-{args.layers}l"
    if not (src / "model.safetensors.index.json").is_file():
        write_synthetic_checkpoint(src, args.synthetic, args.layers)
    source_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    read_rate(src)  # warm the page cache so every run starts alike
    rate = read_rate(src)
    _, baseline, largest = _child("plan", [str(src)])
    rows = []
    for dtype in args.expert_dtype.split(","):
        dst = workdir / f"out-{dtype}"
        seconds, peak, _ = _child("convert", [str(src), str(dst), "--expert-dtype", dtype, "--overwrite",
                                              "--threads", str(args.threads)])
        rows.append({
            "shape": args.synthetic, "layers": args.layers, "expert_dtype": dtype, "threads": args.threads,
            "source_gib": source_bytes / 2**30, "seconds": seconds, "mib_per_s": source_bytes / seconds / MiB,
            "page_cache_mib_per_s": rate / MiB, "fraction_of_read_rate": source_bytes / seconds / rate,
            "peak_rss_mib": peak / MiB, "baseline_rss_mib": baseline / MiB,
            "increment_mib": (peak - baseline) / MiB, "largest_tensor_mib": largest / MiB,
        })
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hybrid-bench convert", description=__doc__.splitlines()[0])
    parser.add_argument("--synthetic", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--expert-dtype", default="int8,int4", help="comma-separated: int8,int4,bf16")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--workdir", default=None, help="where the synthetic source and outputs go (reused)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args(argv)
    rows = run(args)
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    print(f"{args.synthetic}, {args.layers} layers, {rows[0]['source_gib']:.2f} GiB bf16; page cache read "
          f"{rows[0]['page_cache_mib_per_s']:.0f} MiB/s; baseline RSS {rows[0]['baseline_rss_mib']:.0f} MiB; "
          f"largest tensor {rows[0]['largest_tensor_mib']:.0f} MiB")
    print("experts  threads  seconds  MiB/s  of-read-rate  peak-RSS-MiB  increment-MiB")
    for r in rows:
        print(f"{r['expert_dtype']:7s}  {r['threads']:7d}  {r['seconds']:7.1f}  {r['mib_per_s']:5.0f}  "
              f"{r['fraction_of_read_rate']:12.1%}  {r['peak_rss_mib']:12.0f}  {r['increment_mib']:13.0f}")
    return 0
