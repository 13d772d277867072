"""Device check of MLA weight absorption (`gpu_layers.mla_absorb`) against the torch.bmm it replaced, run by hand on
the GPU host (a helper, not a test module): `python3 tests/mla_absorb_device_check.py [OUT_DIR]`.

At DeepSeek-V3.2's dims (128 heads, Dn = Dv = 128, R = 512) and GLM-5's (64 heads, Dn = 192, Dv = 256), bf16, batch
1 and 8, for the query (q_nope W_UK) and the output (o_latent W_UV^T into out [B, H, Dv]; the old path with its
transposing copy):
1. the kernels against the references (float32 bmm rounded once): at most an ulp of bf16 apart;
2. microseconds a call, old and new, over 200 calls replayed in one CUDA graph, the calls cycling through 8 copies
   of the weight (256 MiB at DeepSeek's dims) so each reads its weight from HBM, not from L2; GB/s of weight read.
Prints one JSON line per row and writes them all to OUT_DIR/mla_absorb_check.json; exit status 1 on a mismatch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_layers import mla_absorb  # noqa: E402

MODELS = {"deepseek-v3.2": dict(num_heads=128, **mla_absorb.DEEPSEEK_V3_2),
          "glm-5": dict(num_heads=64, **mla_absorb.GLM_5)}
NUM_COPIES, NUM_CALLS = 8, 200
DEVICE, DTYPE = "cuda", torch.bfloat16


def graph_us(calls) -> float:
    """Microseconds a call: NUM_CALLS calls (cycling through `calls`) captured in one graph, replayed once."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(NUM_CALLS):
            calls[i % len(calls)]()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / NUM_CALLS


def check_model(model: str, dims: dict, batch: int) -> list[dict]:
    h, dn, dv, r = (dims[k] for k in ("num_heads", "nope_dim", "v_head_dim", "rank"))
    weights = [torch.randn(h * (dn + dv), r, device=DEVICE, dtype=DTYPE) / r**0.5 for _ in range(NUM_COPIES)]
    q = torch.randn(batch, h, dn, device=DEVICE, dtype=DTYPE)
    o = torch.randn(h, batch, r, device=DEVICE, dtype=DTYPE)
    q_latent = torch.empty(h, batch, r, device=DEVICE, dtype=DTYPE)
    out = torch.empty(batch, h, dv, device=DEVICE, dtype=DTYPE)
    rows = []
    for op, new, old, ref, weight_bytes in (
        ("query", lambda w: mla_absorb.absorb_query(q, w, dn, out=q_latent),
         lambda w: torch.bmm(q.transpose(0, 1), w.view(h, dn + dv, r)[:, :dn], out=q_latent),
         lambda w: mla_absorb.absorb_query_reference(q, w, dn), h * dn * r * DTYPE.itemsize),
        ("output", lambda w: mla_absorb.absorb_output(o, w, dn, dv, out=out),
         lambda w: out.copy_(torch.bmm(o, w.view(h, dn + dv, r)[:, dn:].transpose(1, 2)).transpose(0, 1)),
         lambda w: mla_absorb.absorb_output_reference(o, w, dn, dv), h * dv * r * DTYPE.itemsize),
    ):
        got = new(weights[0]).float()
        expected = ref(weights[0]).float()
        # an ulp of bf16 (relative 2^-7 at worst) apart, as rounding sums that differ in order can be
        is_close = bool(((got - expected).abs() <= 2**-7 * expected.abs() + 1e-4).all())
        error = (got - expected).abs().max().item()
        new_us = graph_us([lambda w=w, call=new: call(w) for w in weights])
        old_us = graph_us([lambda w=w, call=old: call(w) for w in weights])
        rows.append(dict(model=model, batch=batch, op=op, max_abs_error=error, ok=is_close,
                         old_us=round(old_us, 2), new_us=round(new_us, 2), speedup=round(old_us / new_us, 2),
                         old_weight_gb_s=round(weight_bytes / old_us / 1e3), new_weight_gb_s=round(
                             weight_bytes / new_us / 1e3)))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> int:
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
    rows = [row for model, dims in MODELS.items() for batch in (1, 8) for row in check_model(model, dims, batch)]
    for model in MODELS:
        for batch in (1, 8):
            pair = [r for r in rows if r["model"] == model and r["batch"] == batch]
            old, new = sum(r["old_us"] for r in pair), sum(r["new_us"] for r in pair)
            print(json.dumps(dict(model=model, batch=batch, op="both", old_us=round(old, 2), new_us=round(new, 2),
                                  speedup=round(old / new, 2))))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "mla_absorb_check.json").write_text(json.dumps(rows, indent=1))
    failed = [r for r in rows if not r["ok"]]
    print("FAIL" if failed else "OK", f"{len(rows) - len(failed)}/{len(rows)} rows match their references")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
