"""Device check of dynamic hot experts (`hybrid.hot_experts`) under CUDA graphs, run by hand on the GPU host (a
helper, not a test module): `python3 tests/hot_experts_device_check.py [OUT_DIR] [DEVICE]`.

A tiny Qwen3-MoE (`checkpoints.make_checkpoint`, converted to int8; bf16 on the fused-MoE kernel) keeps 3 experts a
layer on the GPU plus 1 spare slot, and an engine decodes 4 requests through CUDA graphs while a policy forces a
swap in every layer at every step (copies on the side stream, flips between steps). Checks:
1. swaps happen while graphs replay (no re-capture), and after every step the slot table holds exactly the resident
   experts and sends exactly the others to the CPU;
2. the moved placement computes what the same layout installed before any step computes (eager prefill logits,
   bit-equal expected: same weights, same slots), so no copy landed late or in the wrong slot;
3. the greedy tokens against a fixed placement's (3 experts, never moved): identical expected; the fraction is
   reported (bf16 sums the GPU's and the CPU's experts separately, so a near-tie may flip).
Prints one JSON line per result and writes them all to OUT_DIR/hot_experts_check.json; exit status 1 on failure.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from checkpoints import SEEDS, VARIANTS, make_checkpoint, prompt  # noqa: E402
from hot_experts_support import decode_swapping  # noqa: E402

from hybrid import LLM  # noqa: E402
from hybrid.engine import Engine  # noqa: E402
from hybrid.hot_experts import dequantize_expert  # noqa: E402
from hybrid.routed_experts import RoutedExperts  # noqa: E402

PROMPTS = [prompt(n, seed=900 + n) for n in (2, 7, 13, 21)]


def routed(llm) -> list[RoutedExperts]:
    return [m for m in llm.model.modules() if isinstance(m, RoutedExperts)]


def place(module: RoutedExperts, layout: list[int]) -> None:
    """A fixed placement with `layout`'s slots (slot -> expert, -1 spare), installed before any step."""
    module.slot_experts = [-1] * len(layout)
    for slot, expert in enumerate(layout):
        if expert >= 0:
            module.write_slot(slot, *dequantize_expert(module.cpu_experts.op.layer, expert))
    module.slot_experts = list(layout)
    module.gpu_expert_ids = tuple(sorted(e for e in layout if e >= 0))
    module.reset_buffers()
    torch.cuda.synchronize() if torch.cuda.is_available() else None


def main(out_dir: Path, device: str) -> int:
    results, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        from convert.cli import main as convert

        make_checkpoint(VARIANTS["qwen3_moe"](), Path(tmp) / "src", seed=SEEDS["qwen3_moe"])
        assert convert([str(Path(tmp) / "src"), str(Path(tmp) / "dst"), "--expert-dtype", "int8"]) == 0
        args = dict(device=device, dtype="bfloat16" if device != "cpu" else "float32", expert_activations="float")
        hot = LLM(Path(tmp) / "dst", gpu_experts=4, hot_experts_interval=1, **args)
        engine, ids, steps = decode_swapping(hot, PROMPTS, 24, max_num_seqs=4)
        graphs = engine.runner.graphs
        replays = graphs.num_replays if graphs is not None else 0
        got = [engine.requests[i].output_ids for i in ids]
        swaps = hot.hot_experts.num_swaps
        results.append({"check": "swaps under graphs", "steps": steps, "swaps": swaps, "graph_replays": replays,
                        "ok": swaps > 0 and (replays > 0 or device == "cpu")})
        installed = LLM(Path(tmp) / "dst", gpu_experts=4, hot_experts_interval=1, **args)
        for want, module in zip(routed(hot), routed(installed), strict=True):
            place(module, want.slot_experts)
        moved, ref = hot.prefill_logits(PROMPTS[3]), installed.prefill_logits(PROMPTS[3])
        rel = float((moved - ref).abs().max() / ref.abs().max())
        results.append({"check": "moved = installed layout", "bit_equal": bool(torch.equal(moved, ref)),
                        "max_rel_diff": rel, "ok": rel <= 1e-3})
        fixed = LLM(Path(tmp) / "dst", gpu_experts=3, **args)
        want = Engine(fixed, max_num_seqs=4).generate(PROMPTS, max_tokens=24, ignore_eos=True)
        same = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
        results.append({"check": "tokens vs fixed placement", "identical_requests": sum(g == w for g, w in
                        zip(got, want, strict=True)), "same_tokens": same, "tokens": sum(map(len, want)),
                        "ok": got == want})
    for row in results:
        print(json.dumps(row))
        ok &= row["ok"]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "hot_experts_check.json").write_text(json.dumps(results, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "."),
                  sys.argv[2] if len(sys.argv) > 2 else "cuda"))
