"""`hybrid-bench decode` and `hybrid-bench prefill`: the engine on a converted model against its bound.

The model is a converted directory (`--model`) or a synthetic one built and converted on the fly by shape
(`--synthetic qwen3-30b-a3b --layers 2`, cached under `--workdir`). Decode: `--batch` requests, each a short prompt
then `--tokens` decode steps; prefill: one prompt of `--tokens` tokens. Per step the wall time is split into the CPU
experts' compute (timed on their executor thread) and the rest; the bound of a decode step is the routed experts'
bytes read per step over the memory read bandwidth measured in the same run (`cpu_experts.bench.ReadBandwidth`)
plus the time outside the CPU experts that does not overlap them (on a CPU-only machine: all of it).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from cpu_experts.bench import ReadBandwidth, last_level_cache_bytes
from cpu_experts.module import CpuExperts
from hybrid.engine import Engine
from hybrid.llm import LLM
from hybrid.synthetic import SHAPES, write_synthetic_checkpoint


def converted_model(args) -> Path:
    if args.model:
        return Path(args.model)
    from convert.cli import main as convert

    workdir = Path(args.workdir or tempfile.gettempdir()) / "hybrid-bench-engine"
    src = workdir / f"{args.synthetic}-{args.layers}l"
    dst = workdir / f"{args.synthetic}-{args.layers}l-{args.expert_dtype}"
    if not (src / "config.json").exists():
        write_synthetic_checkpoint(src, args.synthetic, args.layers)
    if not (dst / "hybrid.json").exists():
        convert([str(src), str(dst), "--expert-dtype", args.expert_dtype])
    return dst


def timed_cpu_experts(llm: LLM) -> list[float]:
    """Wraps every CpuExperts' compute to add its seconds to the returned list's only element."""
    total = [0.0]
    for module in llm.model.modules():
        if isinstance(module, CpuExperts):
            compute = module.compute

            def timed(*args, _compute=compute):
                start = time.perf_counter()
                _compute(*args)
                total[0] += time.perf_counter() - start

            module.compute = timed
    return total


def expert_bytes_per_step(llm: LLM, num_tokens: int) -> float:
    """Routed experts' bytes one step reads: the expected distinct experts of `num_tokens` uniformly routed
    tokens (prefill: the bound is the read alone, a floor; its arithmetic is `hybrid-bench cpu-moe`'s)."""
    modules = [m for m in llm.model.modules() if isinstance(m, CpuExperts)]
    num_experts, top_k = llm.config.moe.num_experts, llm.config.moe.top_k
    expected_distinct = num_experts * (1 - (1 - top_k / num_experts) ** num_tokens)
    return sum(m.op.layer.expert_bytes() for m in modules) * expected_distinct


def run(args) -> dict:
    torch.manual_seed(0)
    path = converted_model(args)
    llm = LLM(path, device=args.device, dtype=args.dtype, max_model_len=max(args.tokens + 64, 256))
    cpu_seconds = timed_cpu_experts(llm)
    engine = Engine(llm, max_num_batched_tokens=min(llm.max_model_len, max(args.tokens, 64)))
    vocab = llm.config.vocab_size
    if args.mode == "prefill":
        prompts, new_tokens = [torch.randint(vocab, (args.tokens,)).tolist()], 1
    else:
        prompts, new_tokens = [torch.randint(vocab, (16,)).tolist() for _ in range(args.batch)], args.tokens
    for p in prompts:  # warm-up: compiles the kernels
        engine.generate([p[:8]], max_tokens=2, ignore_eos=True)
    ids = [engine.add_request(p, max_tokens=new_tokens, ignore_eos=True) for p in prompts]
    if args.mode == "decode":
        engine.step()  # the prompts: not part of the decode timing
    cpu_seconds[0], steps, start = 0.0, 0, time.perf_counter()
    while engine.has_work():
        engine.step()
        steps += 1
    seconds = time.perf_counter() - start
    tokens = args.tokens if args.mode == "prefill" else sum(len(engine.requests[i].output_ids) for i in ids)
    read_bw = ReadBandwidth(max(8 * last_level_cache_bytes(), 1 << 30))()
    step_s = seconds / max(steps, 1)
    other_s = step_s - cpu_seconds[0] / max(steps, 1)
    routed_tokens = args.tokens if args.mode == "prefill" else args.batch
    bound_s = expert_bytes_per_step(llm, routed_tokens) / read_bw + other_s
    return {"mode": args.mode, "model": str(path), "device": args.device, "batch": args.batch,
            "tokens_per_s": tokens / seconds, "step_ms": step_s * 1e3,
            "cpu_experts_ms": cpu_seconds[0] / max(steps, 1) * 1e3, "other_ms": other_s * 1e3,
            "read_gb_s": read_bw / 1e9, "bound_ms": bound_s * 1e3, "of_bound": bound_s / step_s}


def main(argv: list[str], mode: str) -> int:
    parser = argparse.ArgumentParser(prog=f"hybrid-bench {mode}", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a hybrid-convert output directory")
    parser.add_argument("--synthetic", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--expert-dtype", default="int8", choices=["int8", "int4"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=1, help="decode: concurrent requests")
    parser.add_argument("--tokens", type=int, default=32 if mode == "decode" else 2048)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    args.mode = mode
    row = run(args)
    if args.json:
        print(json.dumps(row))
        return 0
    print(f"{mode} on {row['device']}, batch {row['batch']}: {row['tokens_per_s']:.1f} tokens/s, step "
          f"{row['step_ms']:.2f} ms (CPU experts {row['cpu_experts_ms']:.2f}, other {row['other_ms']:.2f}); bound "
          f"{row['bound_ms']:.2f} ms at {row['read_gb_s']:.1f} GB/s read: {row['of_bound']:.0%} of it")
    return 0


def decode_main(argv: list[str]) -> int:
    return main(argv, "decode")


def prefill_main(argv: list[str]) -> int:
    return main(argv, "prefill")
