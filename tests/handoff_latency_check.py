"""Device check (run by hand on a CUDA machine, not by pytest): the CPU-experts hand-off's round trip alone.

The GPU-alone decode profile spends about 100 us a layer in `wait_flag` although the CPU side answers at once
(docs/benchmarks.md, "Decode layer launches"); the hand-off is two one-thread kernels and a CPU thread. This times
N round trips captured in one CUDA graph: a post kernel writes the request flag in page-locked host memory, one
CPU thread (compiled, spinning) copies each request it sees to the done flag, `gpu_layers.handoff.wait_flag`
polls the done flag. Post variants: the runtime's `post_flag` (a plain store), a store with `.wt` (write-through),
and a `st.release.sys` store (inline PTX: ordered and visible system-wide). If the plain post is the slow one, the
request sat in the GPU's L2 and the fix is in `post_flag`.

    python tests/handoff_latency_check.py [ROUND_TRIPS]
"""

from __future__ import annotations

import statistics
import sys
import threading
import time

import numpy as np
import torch
import triton
import triton.language as tl
from numba import njit

from cpu_experts.atomics import cpu_relax, load_acquire32, store_release32
from gpu_layers.handoff import post_flag_kernel, wait_flag_kernel

STOP = -1


@triton.jit
def post_write_through_kernel(flag_ptr, value):
    tl.store(flag_ptr, value, cache_modifier=".wt")


@triton.jit
def post_release_sys_kernel(flag_ptr, value):
    tl.inline_asm_elementwise("st.release.sys.global.b32 [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                              [flag_ptr, value], dtype=tl.int32, is_pure=False, pack=1)


@njit(nogil=True)
def echo(request_address, done_address):
    """Copies every new request value to the done flag until the request is STOP."""
    last = 0
    while True:
        value = load_acquire32(request_address)
        if value == STOP:
            return
        if value == 0:  # reset between replays: the next replay's values are new again
            last = 0
        elif value != last:
            store_release32(done_address, value)
            last = value
        cpu_relax()


def mapped_flag() -> torch.Tensor:
    """An int32 flag on a 64-byte line of its own in page-locked host memory (kernels reach it through its mapped
    address, as the runtime's flags)."""
    return torch.zeros(16, dtype=torch.int32).pin_memory()


def time_variant(post_kernel, round_trips: int, replays: int = 20) -> float:
    """Median microseconds per round trip over `replays` graph replays of `round_trips` post/wait pairs."""
    request, done = mapped_flag(), mapped_flag()
    thread = threading.Thread(target=echo, args=(request.data_ptr(), done.data_ptr()), daemon=True)
    thread.start()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    values = list(range(1, round_trips + 1))
    with torch.cuda.stream(stream):  # warm up (compile), then capture
        post_kernel[(1,)](request, 1, num_warps=1)
        wait_flag_kernel[(1,)](done, 1, 1 << 28, num_warps=1)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for value in values:
                post_kernel[(1,)](request, value + 1, num_warps=1)
                wait_flag_kernel[(1,)](done, value + 1, 1 << 28, num_warps=1)
    times = []
    for _ in range(replays):
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / round_trips * 1e6)
        request.zero_()  # the echo's `last` resets through 0: the next replay's values are new again
        time.sleep(0.002)
    request.fill_(STOP)
    thread.join(5)
    return statistics.median(times)


def main(argv: list[str]) -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    round_trips = int(argv[0]) if argv else 48
    print(f"{torch.cuda.get_device_name()}: {round_trips} post/wait round trips per graph replay, one echo thread")
    for name, kernel in (("post_flag (plain store)", post_flag_kernel), ("store .wt", post_write_through_kernel),
                         ("st.release.sys", post_release_sys_kernel)):
        try:
            print(f"  {name:26s} {time_variant(kernel, round_trips):8.2f} us per round trip")
        except Exception as exc:  # one variant failing to compile must not hide the others
            print(f"  {name:26s} failed: {type(exc).__name__}: {exc}")
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main(sys.argv[1:]))
