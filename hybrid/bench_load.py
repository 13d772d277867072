"""`hybrid-bench load`: start-up from a checkpoint directory as stored (no conversion), against the disk.

The checkpoint is a directory (`--model`) or a synthetic one of a released shape (`--synthetic deepseek-v3 --layers 4
--fp8`: DeepSeek's published FP8 layout, written under `--workdir` if missing). First the read rate of its
safetensors files: one sequential read of them all with a large buffer, cold (their pages dropped from the page
cache first, where the OS allows) and warm (right after). Then, in a fresh process (so neither this one's imports
nor its memory skew it), `LLM(dir, expert_placement="cpu", ...)` is timed to ready and split into its phases:
building the model, the dense weights, the CPU experts (layer by layer from the checkpoint), page-locking them for
streamed GPU prefill (on CUDA, unless `--gpu-prefill-tokens 0`) and the rest (KV cache, executor). The load rate is
the checkpoint's bytes over the time to ready, compared with both read rates; the child reports its peak RSS.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hybrid.cli_args import add_arguments, from_namespace
from hybrid.engine_config import EngineConfig
from hybrid.synthetic import INDEX_FILE, SHAPES, has_dense_layers, write_synthetic_checkpoint

READ_BUFFER_BYTES = 64 << 20
DEFAULT_MAX_MODEL_LEN = 4096  # the KV cache is part of start-up: a serving-sized one, not the model's 128k+
GB = 1e9
CHILD = "import time; t0 = time.perf_counter(); from hybrid.bench_load import child_main; child_main(t0)"


def checkpoint_dir(args) -> Path:
    """`--model`, or the synthetic checkpoint under `--workdir` (written if missing: its index comes last)."""
    if args.model:
        if not (Path(args.model) / "config.json").is_file():
            raise ValueError(f"--model {args.model}: not a checkpoint directory (no config.json)")
        return Path(args.model)
    dense = args.dense_layers if args.dense_layers is not None else int(has_dense_layers(args.synthetic))
    workdir = Path(args.workdir or tempfile.gettempdir()) / "hybrid-bench-load"
    path = workdir / f"{args.synthetic}-{args.layers}l-{dense}d-{'fp8' if args.fp8 else 'bf16'}"
    if not (path / INDEX_FILE).exists():
        write_synthetic_checkpoint(path, args.synthetic, args.layers, fp8=args.fp8, num_dense_layers=dense)
    return path


def page_cache_bytes() -> int | None:
    """The kernel's page cache size (/proc/meminfo `Cached`), where there is one to read."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Cached:"))
    except (OSError, StopIteration):
        return None


def drop_page_cache(files: list[Path]) -> int | None:
    """Asks the kernel to drop `files`' pages from the page cache (written back first: dirty pages stay); returns
    how much the page cache shrank meanwhile (None where it cannot be read or dropped). A file on tmpfs is its
    pages: nothing drops, and the cold read is a warm one."""
    if not hasattr(os, "posix_fadvise"):
        return None
    before = page_cache_bytes()
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    after = page_cache_bytes()
    return None if before is None or after is None else max(before - after, 0)


def read_rate(files: list[Path]) -> float:
    """Bytes per second of one sequential read of every file in `files`."""
    buffer = memoryview(bytearray(READ_BUFFER_BYTES))
    total, start = 0, time.perf_counter()
    for file in files:
        with open(file, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    return total / (time.perf_counter() - start)


class _PhaseTimer:
    """Records when wrapped functions start and end (the first start, the last end, per phase)."""

    def __init__(self):
        self.marks: dict[str, float] = {}

    def wrap(self, module, name: str, phase: str) -> None:
        """Replaces `module.name` by a timed wrapper (the child's own modules: nothing else runs there)."""
        function = getattr(module, name)

        def timed(*args, **kwargs):
            self.marks.setdefault(phase + "_start", time.perf_counter())
            try:
                return function(*args, **kwargs)
            finally:
                self.marks[phase + "_end"] = time.perf_counter()

        setattr(module, name, timed)


def child_main(t0: float) -> None:
    """The timed start-up (run by `CHILD` in a fresh process): argv is the directory and the EngineConfig as JSON;
    prints one JSON line of seconds by phase, the experts' formats and bytes, and the peak RSS."""
    import resource

    import hybrid.llm as llm_module
    from cpu_experts.module import CpuExperts
    from hybrid import converted, direct_experts

    path, config = sys.argv[1], EngineConfig(**json.loads(sys.argv[2]))
    timer = _PhaseTimer()
    timer.wrap(llm_module, "load_weights", "load")  # what LLM calls, by its own module's name
    timer.wrap(direct_experts, "load_direct_cpu_experts", "experts")
    timer.wrap(converted, "load_cpu_experts", "experts")
    timer.wrap(llm_module, "attach_streamed", "pin")  # on CUDA, streamed prefill page-locks the experts' memory
    start = time.perf_counter()
    llm = llm_module.LLM(path, config=config)
    if config.is_cuda:
        torch.cuda.synchronize()
    ready = time.perf_counter()
    m = timer.marks
    load_start, load_end = m.get("load_start", ready), m.get("load_end", ready)
    pin_s = m["pin_end"] - m["pin_start"] if "pin_start" in m else 0.0
    experts = [module for module in llm.model.modules() if isinstance(module, CpuExperts)]
    row = {"import_s": start - t0, "ready_s": ready - start, "build_s": load_start - start,
           "dense_s": m.get("experts_start", load_end) - load_start,
           "experts_s": load_end - m.get("experts_start", load_end),  # the loader's last step: to its end
           "pin_s": pin_s, "finish_s": ready - load_end - pin_s, "pinned_gb": llm.num_pinned_bytes / GB,
           "expert_formats": sorted({module.op.spec.dtype for module in experts}),
           "expert_gb": sum(module.op.layer.nbytes for module in experts) / GB,
           "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB}
    llm.close()
    print("RESULT " + json.dumps(row), flush=True)


def timed_start_up(path: Path, config: EngineConfig) -> dict:
    """`child_main` in a fresh interpreter (this checkout's packages first); its row plus its whole wall time."""
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), json.dumps(dataclasses.asdict(config))],
                         capture_output=True, text=True, env=env, check=False)
    seconds = time.perf_counter() - start
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the start-up child failed (exit {out.returncode}): {last}")
    return json.loads(line.removeprefix("RESULT ")) | {"child_s": seconds}


def run(args) -> dict:
    path = checkpoint_dir(args)
    config = from_namespace(EngineConfig, args)
    files = sorted(path.rglob("*.safetensors"))  # a converted directory's expert files are under experts/
    weights = sum(p.stat().st_size for p in files)
    dropped = drop_page_cache(files)
    cold = read_rate(files)
    warm = read_rate(files)
    if args.cold_start:
        drop_page_cache(files)
    child = timed_start_up(path, config)
    load_rate = weights / GB / child["ready_s"]
    return {"mode": "load", "model": str(path), "device": config.device, "expert_dtype": config.expert_dtype,
            "is_cold_start": args.cold_start, "checkpoint_gb": weights / GB, "num_files": len(files),
            "cold_read_gb_s": cold / GB, "warm_read_gb_s": warm / GB,
            "dropped_gb": None if dropped is None else dropped / GB, **child, "load_gb_s": load_rate,
            "of_cold_read": load_rate * GB / cold, "of_warm_read": load_rate * GB / warm}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hybrid-bench load", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a checkpoint directory (instead of a synthetic one)")
    parser.add_argument("--synthetic", choices=sorted(SHAPES), default="deepseek-v3")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dense-layers", type=int, default=None,
                        help="synthetic: dense layers first (default: 1 where the shape has any, so most layers are "
                             "MoE as in the released model)")
    parser.add_argument("--fp8", action="store_true", help="synthetic: DeepSeek's published FP8 layout, not bf16")
    parser.add_argument("--workdir", default=None, help="where the synthetic checkpoint goes (reused)")
    parser.add_argument("--cold-start", action="store_true",
                        help="drop the checkpoint from the page cache before the start-up, not only before the "
                             "cold read")
    parser.add_argument("--json", action="store_true")
    add_arguments(parser, EngineConfig)
    parser.set_defaults(device="cuda" if torch.cuda.is_available() else "cpu", expert_placement="cpu",
                        max_model_len=DEFAULT_MAX_MODEL_LEN)
    args = parser.parse_args(argv)
    try:
        row = run(args)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"hybrid-bench load: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(row))
        return 0
    dropped = "not dropped" if row["dropped_gb"] is None else f"{row['dropped_gb']:.2f} GB dropped before it"
    print(f"load of {row['model']} ({row['checkpoint_gb']:.2f} GB in {row['num_files']} files) on {row['device']}"
          f"{', cold start' if row['is_cold_start'] else ''}: ready in {row['ready_s']:.2f} s at "
          f"{row['load_gb_s']:.2f} GB/s (imports before it {row['import_s']:.2f} s)")
    print(f"phases: build {row['build_s']:.2f} s, dense weights {row['dense_s']:.2f} s, CPU experts "
          f"{row['experts_s']:.2f} s ({'/'.join(row['expert_formats']) or 'none'}, {row['expert_gb']:.2f} GB), "
          f"page-locking {row['pin_s']:.2f} s ({row['pinned_gb']:.2f} GB), rest {row['finish_s']:.2f} s; "
          f"peak RSS {row['peak_rss_gb']:.2f} GB")
    print(f"read rate: cold {row['cold_read_gb_s']:.2f} GB/s ({dropped}), warm {row['warm_read_gb_s']:.2f} GB/s; "
          f"the load runs at {row['of_cold_read']:.0%} of the cold and {row['of_warm_read']:.0%} of the warm rate")
    return 0
