"""Device check of the per-rank metrics at tp=2 on 2 GPUs (a helper, not a test module), run by hand:
`python3 tests/tp_metrics_device_check.py [OUT_DIR]`. A small DeepSeek-V3 with its experts on the CPU operator
(int8, each rank its slice of I) and 4 a layer on the GPUs decodes 4 requests through CUDA graphs (the flag worker's
and decode pool's CPU seconds counted); then every rank's row must show the same steps, CPU experts' seconds and GPU
memory (allocated and reserved) of its own GPU, and `/metrics`' text must carry them by rank. Also the cost of one
publish with the memory sampled (the once-a-second case) and without. Prints one JSON line, writes
OUT_DIR/tp_metrics.json; exit status 1 where a check fails."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from checkpoints import make_checkpoint, prompt  # noqa: E402
from tp_device_check import VOCAB, deepseek_v3  # noqa: E402

from hybrid import LLM  # noqa: E402
from hybrid.engine import Engine  # noqa: E402
from server.metrics import Metrics  # noqa: E402


def publish_us(counters, force_memory: bool, repeats: int = 1000) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        if force_memory:
            counters._memory_sampled_at = float("-inf")
        counters.publish()
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint(deepseek_v3(), Path(tmp), seed=1, dtype=torch.bfloat16)
        llm = LLM(tmp, device="cuda", dtype="bfloat16", tensor_parallel_size=2, max_model_len=512,
                  expert_placement="cpu", gpu_experts=4)
        try:
            engine = Engine(llm, max_num_seqs=4)
            engine.generate([prompt(n, seed=n, vocab=VOCAB) for n in (5, 17, 33, 64)], max_tokens=24, ignore_eos=True)
            replays = engine.runner.graphs.num_replays if engine.runner.graphs is not None else 0
            time.sleep(0.5)  # the worker's last publish
            ranks = llm.rank_stats()
            text = Metrics().render(engine.stats(), ranks).decode()
            cost = {"publish_us": publish_us(llm.counters, False), "publish_with_memory_us":
                    publish_us(llm.counters, True)}
            engine.close()
        finally:
            llm.close()
    ok = (replays > 0 and len(ranks) == 2 and all(r.is_alive for r in ranks)
          and ranks[0].num_steps == ranks[1].num_steps > 0 and all(r.cpu_experts_seconds > 0 for r in ranks)
          and all(r.gpu_allocated_bytes and r.gpu_reserved_bytes >= r.gpu_allocated_bytes for r in ranks)
          and all(f'hybrid_rank_gpu_memory_allocated_bytes{{rank="{r}"}}' in text for r in "01"))
    row = {"check": "per-rank metrics tp=2", "ok": ok, "graph_replays": replays,
           "ranks": [vars(r) for r in ranks], **cost}
    print(json.dumps(row), flush=True)
    (out / "tp_metrics.json").write_text(json.dumps(row, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
