"""Device check of the dense Qwen3.5 (`Qwen3_5ForConditionalGeneration`, no routed experts) on the GPU, run by hand
on the GPU host (a helper, not a test module): `python3 tests/qwen3_5_dense_device_check.py [OUT_DIR]`.

A tiny checkpoint that transformers writes (its multimodal wrapper, dims the kernels take: GDN heads 64 / 64,
attention head 64), served with the default CUDA settings (`expert_placement` auto, which is the CPU operator on
CUDA: nothing to place, so no CPU executor starts):
1. float32 through the Triton kernels: prefill logits of 1, 7, 33 and 200 tokens within 1e-4 of the largest
   transformers logit;
2. bf16: an engine decoding 4 requests (chunked prefill) through CUDA graphs gives the eager engine's tokens, and
   replays graphs.
Prints one JSON line per result and writes them all to OUT_DIR/qwen3_5_dense_check.json; exit status 1 on a failure.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qwen3_next_support import PROMPT_LENS, random_prompt, write_qwen3_5_dense  # noqa: E402

from hybrid.engine import Engine  # noqa: E402
from hybrid.llm import LLM  # noqa: E402

DEVICE = "cuda"
KERNEL_DIMS = dict(head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=1,
                   linear_num_value_heads=2)


def prefill_parity(path: Path, model, lengths=PROMPT_LENS) -> list[dict]:
    llm = LLM(path, device=DEVICE, dtype="float32", kernels="triton", max_model_len=256, max_num_seqs=4)
    assert llm.cpu_executor is None and llm.backends.attention.name == "triton"
    model = model.to(DEVICE)
    rows = []
    for length in lengths:
        prompt = random_prompt(length, seed=length)
        with torch.no_grad():
            ref = model(torch.tensor([prompt], device=DEVICE)).logits[0].float()
        error = ((llm.prefill_logits(prompt) - ref).abs().max() / ref.abs().max()).item()
        rows.append({"check": "prefill float32", "tokens": length, "relative_error": error, "ok": error <= 1e-4})
    llm.close()
    return rows


def graph_equals_eager(path: Path) -> dict:
    prompts = [random_prompt(n, seed=90 + n) for n in (1, 9, 21, 40)]
    outputs, replays = {}, 0
    for is_graph in (False, True):
        llm = LLM(path, device=DEVICE, dtype="bfloat16", kernels="triton", cuda_graph=is_graph, max_model_len=256,
                  max_num_seqs=4)
        engine = Engine(llm, max_num_batched_tokens=16, max_num_seqs=4)
        outputs[is_graph] = engine.generate(prompts, max_tokens=24, ignore_eos=True)
        if is_graph and engine.runner.graphs is not None:
            replays = engine.runner.graphs.num_replays
        engine.close()
        llm.close()
    return {"check": "bf16 graph decode = eager", "replays": replays,
            "ok": outputs[True] == outputs[False] and replays > 0}


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_qwen3_5_dense(transformers, tmp, **KERNEL_DIMS)
        rows = [*prefill_parity(Path(tmp), model), graph_equals_eager(Path(tmp))]
    for row in rows:
        print(json.dumps(row))
    (out / "qwen3_5_dense_check.json").write_text(json.dumps(rows, indent=1))
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
