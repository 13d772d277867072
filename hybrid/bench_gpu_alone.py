"""The GPU-alone decode step of `hybrid-bench decode`: the CPU experts answering at once (zeros, from the worker and
the decode pool alike), so that what is left is the GPU's own work and the hand-off; and a torch.profiler summary of
that step by kernel (`--profile STEPS`)."""

from __future__ import annotations

import contextlib

import torch

from cpu_experts.decode_pool import DecodePool
from cpu_experts.module import CpuExperts
from hybrid.engine import Engine
from hybrid.llm import LLM
from hybrid.sampling import SamplingParams


def decode_pool_of(engine: Engine) -> DecodePool | None:
    return engine.runner.graphs.pool if engine.runner.graphs is not None else None


@contextlib.contextmanager
def cpu_experts_answer_at_once(engine: Engine, llm: LLM):
    """Inside: every CPU-experts call returns zeros at once (worker and decode pool), leaving the GPU's own work
    and the hand-off."""
    modules = [m for m in llm.model.modules() if isinstance(m, CpuExperts)]
    saved = [m.compute for m in modules]
    for m in modules:
        m.compute = lambda hidden, ids, weights, out: out.zero_()
    pool = decode_pool_of(engine)
    if pool is not None:
        pool.skip_compute = True
    try:
        yield
    finally:
        for m, compute in zip(modules, saved, strict=True):
            m.compute = compute
        if pool is not None:
            pool.skip_compute = False


def profile_decode(engine: Engine, llm: LLM, args, params: SamplingParams) -> list[tuple[str, float, float]]:
    """torch.profiler over `args.profile` decode steps of the GPU-alone step (CPU experts answering at once; the
    prompts' step runs before the profiler starts) -> (kernel or copy, launches per step, GPU microseconds per
    step), most time first."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    vocab = llm.config.vocab_size
    with cpu_experts_answer_at_once(engine, llm):
        ids = [engine.add_request(torch.randint(vocab, (args.context,)).tolist(), params,
                                  max_tokens=args.profile + 1, ignore_eos=True) for _ in range(args.batch)]
        while not all(engine.requests[i].output_ids for i in ids):
            engine.step()
        torch.cuda.synchronize()
        steps = 0
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            while engine.has_work():
                engine.step()
                steps += 1
            torch.cuda.synchronize()
        for i in ids:
            engine.requests.pop(i)
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", 0)
        if event.device_type == DeviceType.CUDA and device_us > 0:  # kernels and copies, graph nodes included
            rows.append((event.key, event.count / max(steps, 1), device_us / max(steps, 1)))
    return sorted(rows, key=lambda row: -row[2])


def print_profile(rows: list[tuple[str, float, float]], num_layers: int, top: int = 30) -> None:
    if not rows:
        print("GPU-alone decode step by kernel: the profiler recorded no device activity")
        return
    launches, total_us = sum(r[1] for r in rows), sum(r[2] for r in rows)
    print(f"GPU-alone decode step by kernel (torch.profiler, per step): {launches:.0f} launches, {total_us:.0f} us "
          f"of kernel time ({launches / num_layers:.1f} launches, {total_us / num_layers:.1f} us per layer)")
    print(f"{'us/step':>9} {'calls/step':>10}  kernel")
    for name, calls, device_us in rows[:top]:
        print(f"{device_us:9.1f} {calls:10.1f}  {name[:100]}")
