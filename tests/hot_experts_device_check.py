"""Device check of dynamic hot experts (`hybrid.hot_experts`) under CUDA graphs, run by hand on the GPU host (a
helper, not a test module): `python3 tests/hot_experts_device_check.py [OUT_DIR] [DEVICE]`.

A tiny Qwen3-MoE with the head dims the Triton attention takes (`checkpoints.kernel_config`: head_dim 64; the
parity variant's 24 runs on the PyTorch attention, under which no engine captures graphs, so the first run of this
check replayed none), converted to int8, bf16 on the fused-MoE kernel, keeps 3 experts a layer on the GPU plus 1
spare slot, and an engine decodes 4 requests through CUDA graphs while a policy forces a swap in every layer at
every step (copies staged and dequantized on the side stream, flips between steps). Checks:
1. swaps happen while graphs replay (captured once, no re-capture), and after every step the slot table holds
   exactly the resident experts and sends exactly the others to the CPU;
2. the moved placement computes what the same layout installed before any step computes (eager prefill logits,
   bit-equal expected: the side stream's dequantization equals the loader's, same slots), so no copy landed late
   or in the wrong slot;
3. the greedy tokens against a fixed placement's (3 experts, never moved): the two sum their experts in different
   groups (GPU slots against the CPU operator) in bf16, so exact equality is not a contract; what must hold is
   that each request's tokens equal the fixed placement's up to their first difference, and there the fixed
   placement's logits of the two tokens are within TIE_MARGIN of max |logit| (a near-tie that rounding flipped,
   not a wrong expert, which moves logits by far more). Identical requests and tokens are reported.
Prints one JSON line per result and writes them all to OUT_DIR/hot_experts_check.json; exit status 1 on failure.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from checkpoints import SEEDS, kernel_config, make_checkpoint, prompt  # noqa: E402
from hot_experts_support import decode_swapping  # noqa: E402

from hybrid import LLM  # noqa: E402
from hybrid.engine import Engine  # noqa: E402
from hybrid.hot_experts import dequantize_expert  # noqa: E402
from hybrid.routed_experts import RoutedExperts  # noqa: E402

PROMPTS = [prompt(n, seed=900 + n) for n in (2, 7, 13, 21)]
# of max |logit|: a few bf16 roundings (2^-8 each) summed over the layers; a wrong or stale expert moves the
# logits by whole percents of their range
TIE_MARGIN = 0.02


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


def compare_tokens(fixed, got: list[list[int]], want: list[list[int]]) -> dict:
    """Check 3 (module docstring): each request's first difference from the fixed placement's tokens, and the
    fixed placement's logits there (eager prefill of the prompt and the common tokens) of both tokens."""
    divergences = []
    for request, (p, g, w) in enumerate(zip(PROMPTS, got, want, strict=True)):
        at = next((i for i, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), None)
        if at is None:
            continue
        logits = fixed.prefill_logits(p + w[:at])[-1].float()
        gap = float((logits[w[at]] - logits[g[at]]).abs() / logits.abs().max())
        divergences.append({"request": request, "at": at, "tokens": [w[at], g[at]], "gap": gap})
    same = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    return {"check": "tokens vs fixed placement", "identical_requests": len(got) - len(divergences),
            "same_tokens": same, "tokens": sum(map(len, want)), "divergences": divergences,
            "tie_margin": TIE_MARGIN, "ok": all(d["gap"] <= TIE_MARGIN for d in divergences)}


def main(out_dir: Path, device: str) -> int:
    results, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        from convert.cli import main as convert

        make_checkpoint(kernel_config("qwen3_moe"), Path(tmp) / "src", seed=SEEDS["qwen3_moe"])
        assert convert([str(Path(tmp) / "src"), str(Path(tmp) / "dst"), "--expert-dtype", "int8"]) == 0
        args = dict(device=device, dtype="bfloat16" if device != "cpu" else "float32", expert_activations="float")
        hot = LLM(Path(tmp) / "dst", gpu_experts=4, hot_experts_interval=1, **args)
        engine, ids, steps = decode_swapping(hot, PROMPTS, 24, max_num_seqs=4)
        graphs = engine.runner.graphs
        replays = graphs.num_replays if graphs is not None else 0
        got = [engine.requests[i].output_ids for i in ids]
        swaps = hot.hot_experts.num_swaps
        results.append({"check": "swaps under graphs", "steps": steps, "swaps": swaps,
                        "cuda_graph": graphs is not None, "graph_replays": replays,
                        "ok": swaps > 0 and (replays > 0 or device == "cpu")})
        installed = LLM(Path(tmp) / "dst", gpu_experts=4, hot_experts_interval=1, **args)
        for want, module in zip(routed(hot), routed(installed), strict=True):
            place(module, want.slot_experts)
        moved, ref = hot.prefill_logits(PROMPTS[3]), installed.prefill_logits(PROMPTS[3])
        rel = float((moved - ref).abs().max() / ref.abs().max())
        results.append({"check": "moved = installed layout", "bit_equal": bool(torch.equal(moved, ref)),
                        "max_rel_diff": rel, "ok": bool(torch.equal(moved, ref))})
        fixed = LLM(Path(tmp) / "dst", gpu_experts=3, **args)
        want = Engine(fixed, max_num_seqs=4).generate(PROMPTS, max_tokens=24, ignore_eos=True)
        results.append(compare_tokens(fixed, got, want))
    for row in results:
        print(json.dumps(row))
        ok &= row["ok"]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "hot_experts_check.json").write_text(json.dumps(results, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "."),
                  sys.argv[2] if len(sys.argv) > 2 else "cuda"))
