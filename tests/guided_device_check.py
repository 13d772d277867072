"""Device check of grammar-constrained sampling on CUDA (`hybrid.sampling.apply_token_mask`, `hybrid.guided`), run
by hand on the GPU host (a helper, not a test module): `python3 tests/guided_device_check.py [OUT_DIR]`.

1. the mask applied on the device from the engine's page-locked buffer equals xgrammar's own CPU kernel on the
   same logits (bit-equal: -inf where a bit is clear, the logits elsewhere), 1 and 32 rows of V = 151,936, and
   sample_batch's greedy rows pick the masked argmax;
2. nothing on the mask's way waits for the step: behind a spin kernel of SPIN_MS queued on the stream (the step's
   stand-in), the host time of apply_token_mask and of the sampler's host-list copy (`_to_device`) stays far below
   it; the same copy from pageable memory is timed beside them (whether CUDA waits there: why the buffers are
   page-locked);
3. sample_batch with a mask synchronises once (CUDA's sync debug mode), as without one.
Prints one JSON line per result and writes them all to OUT_DIR/guided_check.json; exit status 1 on failure.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

import torch
import xgrammar

from hybrid.guided import GrammarCache, GuidedRequests
from hybrid.sampling import RowInputs, SamplingParams, TokenMask, _to_device, apply_token_mask, sample_batch

VOCAB = 151_936  # Qwen3's logits
SPIN_MS = 50.0
NOT_WAITING_MS = 5.0  # a host call behind the spin that returns within this did not wait for it


def page_locked_mask(num_rows: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(random words [num_rows, W] int32 on the host, the same in the engine's page-locked buffer)."""
    words = torch.randint(-2 ** 31, 2 ** 31, (num_rows, (VOCAB + 31) // 32), dtype=torch.int32, generator=generator)
    buffer = GuidedRequests(GrammarCache(VOCAB), pin_memory=True)._rows(num_rows)
    assert buffer.is_pinned()
    return words, buffer.copy_(words)


def check_values(device: str) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    results = []
    for num_rows in (1, 32):
        logits = torch.randn(num_rows, VOCAB, generator=generator)
        words, pinned = page_locked_mask(num_rows, generator)
        masked, disallowed = apply_token_mask(logits.to(device), TokenMask(pinned))
        expected = logits.clone()
        xgrammar.apply_token_bitmask_inplace(expected, words)
        tokens = sample_batch(logits.to(device), [RowInputs(SamplingParams())] * num_rows,
                              mask=TokenMask(pinned)).token_ids
        ok = (torch.equal(masked.cpu(), expected) and torch.equal(disallowed.cpu(), expected == float("-inf"))
              and tokens == expected.argmax(dim=-1).tolist())
        results.append({"check": "mask_values", "rows": num_rows, "ok": ok,
                        "allowed_per_row": (~disallowed).sum(dim=-1).float().mean().item()})
    return results


def spin_cycles(device: str) -> int:
    """Clock cycles of `torch.cuda._sleep` that take SPIN_MS (timed with events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize(device)
    return int(cycles * SPIN_MS / start.elapsed_time(end))


def host_ms_behind_spin(fn, device: str, cycles: int) -> tuple[float, float]:
    """(host ms of `fn` called behind the spin, ms until the stream is done: the spin's own length)."""
    fn()  # first use: allocations, the mask's constants
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    torch.cuda._sleep(cycles)
    launched = time.perf_counter()
    fn()
    host_ms = (time.perf_counter() - launched) * 1e3
    torch.cuda.synchronize(device)
    return host_ms, (time.perf_counter() - start) * 1e3


def check_no_wait(device: str) -> list[dict]:
    cycles = spin_cycles(device)
    words, pinned = page_locked_mask(1, torch.Generator().manual_seed(1))
    logits = torch.randn(1, VOCAB, device=device)
    calls = {"pageable_copy": lambda: words.to(device, non_blocking=True),
             "page_locked_copy": lambda: pinned.to(device, non_blocking=True),
             "apply_token_mask": lambda: apply_token_mask(logits, TokenMask(pinned)),
             "sampler_host_list": lambda: _to_device([0, 1, 2], torch.long, torch.device(device))}
    results = []
    for name, fn in calls.items():
        host_ms, stream_ms = host_ms_behind_spin(fn, device, cycles)
        waited = host_ms > NOT_WAITING_MS
        results.append({"check": "no_wait", "call": name, "host_ms": round(host_ms, 3),
                        "stream_ms": round(stream_ms, 1), "waited": waited,
                        "ok": stream_ms > 2 * NOT_WAITING_MS and (name == "pageable_copy" or not waited)})
    return results


def check_one_sync(device: str) -> dict:
    generator = torch.Generator().manual_seed(2)
    rows = [RowInputs(SamplingParams()), RowInputs(SamplingParams(temperature=1.0, seed=3),
                                                   torch.Generator(device).manual_seed(3)),
            RowInputs(SamplingParams(temperature=0.7, top_p=0.9, logprobs=2))]
    logits = torch.randn(len(rows), VOCAB, device=device)
    _, pinned = page_locked_mask(len(rows), generator)
    sample_batch(logits, rows, mask=TokenMask(pinned))  # warm up: lazy initialisation may synchronise once
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sample_batch(logits, rows, mask=TokenMask(pinned))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    return {"check": "one_sync", "syncs": len(syncs), "ok": len(syncs) == 1}


def main(out_dir: Path) -> int:
    device = "cuda"
    results = check_values(device) + check_no_wait(device) + [check_one_sync(device)]
    for result in results:
        print(json.dumps(result))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "guided_check.json").write_text(json.dumps(results, indent=1))
    ok = all(r["ok"] for r in results)
    print("guided check:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")))
