"""The gate and benchmark cases of gpu_layers.dsa (read through its gate_cases and bench_cases): the scoring
kernel at each gated model's indexer heads and the select's kernels for each capability's config, and timings of
the scores, the indexer and the select against the first build's select (`dsa_refine_select`)."""

from __future__ import annotations

import torch

from gpu_layers.capability import CAPABILITIES, GateCase, select
from gpu_layers.dsa import (
    NUM_PASSES,
    SCORES_CONFIGS,
    SELECT_CONFIGS,
    TRITON_DTYPES,
    head_block,
    index_scores,
    index_scores_kernel,
    index_topk,
    select_topk,
    topk_gather_kernel,
    topk_pass_kernel,
)

GATED_HEADS = {"deepseek-v3.2": (64, 128), "glm-5": (32, 128)}  # (indexer heads, head dim)


def _scores_signature(dtype: str) -> dict[str, str]:
    sig = dict(q=f"*{dtype}", weights="*fp32", cache=f"*{dtype}", block_tables="*i32", row_seq="*i32",
               row_limit="*i32", scores="*fp32", counts="*i32", scale="fp32")
    for name in ("max_context", "page_size", "min_selecting", "stride_q_n", "stride_q_h", "stride_w_n", "stride_bt"):
        sig[name] = "i32"
    constexprs = ("H", "D", "BLOCK_H", "BLOCK_D", "BLOCK_K", "BLOCK_N", "FOR_SELECT")
    return sig | {name: "constexpr" for name in constexprs}



def _select_gate_cases(capability: int) -> list[GateCase]:
    cfg = select(SELECT_CONFIGS, capability)
    sig = dict(scores="*fp32", counts="*i32", tile_counts="*i32", row_limit="*i32", stride_s="i32", stride_t="i32",
               max_context="i32", k="i32", BLOCK_G="constexpr")
    cases = [GateCase(topk_pass_kernel, sig | {"PASS": "constexpr"}, dict(PASS=radix_pass, BLOCK_G=cfg.block_g),
                      capability, f"topk_pass {radix_pass} {cfg}", cfg.num_warps, 1)
             for radix_pass in range(NUM_PASSES)]
    gather_sig = {name: sig[name] for name in ("scores", "counts", "tile_counts")} | {"out": "*i32"}
    gather_sig |= {name: kind for name, kind in sig.items() if name not in gather_sig} | {"BLOCK_T": "constexpr"}
    cases.append(GateCase(topk_gather_kernel, gather_sig, dict(BLOCK_G=cfg.block_g, BLOCK_T=cfg.block_t),
                          capability, f"topk_gather {cfg}", cfg.num_warps, 1))
    return cases


def gate() -> list[GateCase]:
    """The scores kernel at V3.2's and GLM-5's heads, each dtype's config, plain and for selection; the selection
    kernels (float32 scores whatever the cache's dtype), for each capability."""
    cases = []
    for capability in CAPABILITIES:
        for torch_dtype, dtype in TRITON_DTYPES.items():
            cfg = select(SCORES_CONFIGS, capability)[torch_dtype.itemsize]
            for model, (num_heads, head_dim) in GATED_HEADS.items():
                for for_select in (False, True):
                    constexprs = dict(H=num_heads, D=head_dim, BLOCK_H=head_block(num_heads),
                                      BLOCK_D=head_block(head_dim), BLOCK_K=cfg.block_k, BLOCK_N=cfg.block_n,
                                      FOR_SELECT=for_select)
                    label = f"index_scores {dtype} {model}{' for select' if for_select else ''} {cfg}"
                    cases.append(GateCase(index_scores_kernel, _scores_signature(dtype), constexprs, capability,
                                          label, cfg.num_warps, 1))
        cases += _select_gate_cases(capability)
    return cases


def _bench_problem(batch: int, context: int, num_heads: int, cache, direction=None) -> dict:
    """Decode rows of `batch` sequences of `context` tokens over shuffled pages of the shared cache: Gaussian
    queries, weights of both signs; or, given the unit `direction` u the cache was shifted by 3 along, every
    head's query -u and positive weights: a token scores above 0 only where its noise along u is below -3 (about
    0.13%), every other one exactly 0, so the k-th largest is a 0 tied with most of the row (ReLU scores' ties)."""
    device, page_size, head_dim = cache.device, cache.shape[1], cache.shape[3]
    pages = context // page_size
    tables = torch.randperm(cache.shape[0], device=device)[: batch * pages].view(batch, pages).int()
    q = torch.randn(batch, num_heads, head_dim, device=device, dtype=cache.dtype)
    weights = torch.randn(batch, num_heads, device=device) * num_heads**-0.5
    if direction is not None:
        q = (-direction).to(cache.dtype).expand(batch, num_heads, head_dim).contiguous()
        weights = weights.abs()
    return dict(q=q, weights=weights, index_cache=cache, block_tables=tables,
                row_seq=torch.arange(batch, dtype=torch.int32, device=device),
                row_limit=torch.full((batch,), context, dtype=torch.int32, device=device),
                scale=head_dim**-0.5, max_context=context)


def _bench_scores(batch: int, context: int, distribution: str, device) -> torch.Tensor:
    """select_topk's inputs: "random" Gaussian; "zeros" 0.1% positive, the rest exactly 0; "narrow" within one
    part in a thousand of 1 (no ties, but one coarse float16 bin holds the whole row)."""
    if distribution == "random":
        return torch.randn(batch, context, device=device)
    if distribution == "zeros":
        return torch.where(torch.rand(batch, context, device=device) < 1e-3,
                           torch.rand(batch, context, device=device), 0.0)
    return 1 + 1e-3 * torch.rand(batch, context, device=device)


def bench() -> list[tuple]:
    """Decode rows (batch 1 and 8 at 8K, 32K and 128K), bf16 keys in pages of 64, k = 2048, V3.2's 64 heads (and
    GLM-5's 32 at 128K): the scores alone (keys read + scores written); the whole indexer on random and on
    zero-tied scores (`_bench_problem`); the selection alone on random, zero-tied and narrow scores (scores read).
    The selections' baseline is the first build's select (`dsa_refine_select`: coarse bins, one-program refine)
    on the same scores; the indexer's runs it after index_scores (a histogram kernel more than its fused form)."""
    from gpu_layers import dsa_refine_select

    device, page_size, head_dim, k = torch.device("cuda"), 64, 128, 2048
    shapes = ((1, 8192), (1, 32768), (1, 131072), (8, 8192), (8, 32768), (8, 131072))
    cache = torch.randn(max(b * c for b, c in shapes) // page_size, page_size, 1, head_dim, device=device,
                        dtype=torch.bfloat16)
    direction = torch.nn.functional.normalize(torch.randn(head_dim, device=device), dim=0)
    caches = {"random": (cache, None), "zeros": ((cache.float() + 3 * direction).to(cache.dtype), direction)}
    cases = []
    for batch, context in shapes:
        where = f"B={batch} ctx={context}"
        key_bytes, score_bytes = batch * context * head_dim * 2, batch * context * 4
        scores = torch.empty(batch, context, device=device)
        out = torch.empty(batch, k, dtype=torch.int32, device=device)
        models = GATED_HEADS if context == 131072 else {"deepseek-v3.2": GATED_HEADS["deepseek-v3.2"]}
        for (model, (num_heads, _)), distribution in [(m, "random") for m in models.items()] + [
                (("deepseek-v3.2", GATED_HEADS["deepseek-v3.2"]), "zeros")]:
            p = _bench_problem(batch, context, num_heads, *caches[distribution])
            flops = 2 * batch * context * num_heads * head_dim

            def run_scores(p=p, scores=scores):
                index_scores(**p, out=scores)

            def run_topk(p=p, out=out):
                index_topk(**p, k=k, out=out)

            def run_baseline(p=p, scores=scores, out=out):
                index_scores(**p, out=scores)
                dsa_refine_select.select_topk(scores, p["row_limit"], k, out)

            if distribution == "random":
                cases.append((f"dsa.index_scores {model} {where}", run_scores, key_bytes + score_bytes, flops))
            cases.append((f"dsa.index_topk {model} {distribution} {where}", run_topk,
                          key_bytes + 2 * score_bytes, flops, run_baseline))
        limits = torch.full((batch,), context, dtype=torch.int32, device=device)
        for distribution in ("random", "zeros", "narrow"):
            given = _bench_scores(batch, context, distribution, device)
            cases.append((f"dsa.select_topk {distribution} {where}",
                          lambda s=given, r=limits, o=out: select_topk(s, r, k, out=o), score_bytes, 0,
                          lambda s=given, r=limits, o=out: dsa_refine_select.select_topk(s, r, k, o)))
    return cases
