"""Device side of the CPU-experts hand-off inside CUDA graphs: one-thread kernels that post a value to an int32
flag in page-locked host memory and that wait, on the GPU, until the CPU has posted one back.

Data flow: `post_flag(flag, value)` stores value into flag[0] (host memory the CPU polls); `wait_flag(flag,
value, max_polls)` spins on volatile reads of flag[0] until it equals value (or `max_polls` reads have gone by,
so a dead CPU side cannot hang the GPU forever), then stores 0 there: each value is consumed once. Both take a
flag tensor that is pinned host memory (reached through its mapped device address) or device memory (tests).
The reference is `post_flag_reference` / `wait_flag_reference`, the same steps on the host.

Why a kernel and not a host node: the wait runs on the GPU, so a replayed graph needs no host callback (no GIL,
no driver callback thread) between the CPU finishing a layer and the GPU going on.
"""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl

from gpu_layers.capability import CAPABILITIES, GateCase

# Volatile reads of host memory take about a microsecond over PCIe: 2^28 of them is minutes, far beyond any layer.
DEFAULT_MAX_POLLS = 1 << 28


@triton.jit
def post_flag_kernel(flag_ptr, value):
    tl.store(flag_ptr, value)


@triton.jit
def wait_flag_kernel(flag_ptr, value, max_polls):
    seen = tl.load(flag_ptr, volatile=True)
    polls = 0
    while (seen != value) & (polls < max_polls):
        seen = tl.load(flag_ptr, volatile=True)
        polls += 1
    tl.store(flag_ptr, 0)


def _check_flag(flag: torch.Tensor) -> None:
    if flag.dtype != torch.int32 or flag.numel() < 1:
        raise ValueError(f"flag must be an int32 tensor with at least one element, got {flag.dtype} "
                         f"{tuple(flag.shape)}")
    if not (flag.is_cuda or flag.is_pinned()):
        raise ValueError("flag must be CUDA memory or page-locked host memory (pin_memory=True)")


def post_flag(flag: torch.Tensor, value: int) -> None:
    """On the current stream: flag[0] = value (> 0)."""
    _check_flag(flag)
    if value <= 0:
        raise ValueError(f"value must be > 0 (0 means 'nothing posted'), got {value}")
    post_flag_kernel[(1,)](flag, value, num_warps=1)


def wait_flag(flag: torch.Tensor, value: int, max_polls: int = DEFAULT_MAX_POLLS) -> None:
    """On the current stream: wait until flag[0] == value, then flag[0] = 0."""
    _check_flag(flag)
    if value <= 0 or max_polls < 1:
        raise ValueError(f"value and max_polls must be > 0, got {value} and {max_polls}")
    wait_flag_kernel[(1,)](flag, value, max_polls, num_warps=1)


def post_flag_reference(flag: torch.Tensor, value: int) -> None:
    flag[0] = value


def wait_flag_reference(flag: torch.Tensor, value: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while int(flag[0]) != value and time.monotonic() < deadline:
        time.sleep(0)
    flag[0] = 0


def gate_cases() -> list[GateCase]:
    cases = []
    for capability in CAPABILITIES:
        cases.append(GateCase(kernel=post_flag_kernel, signature={"flag_ptr": "*i32", "value": "i32"},
                              constexprs={}, capability=capability, label="post_flag", num_warps=1))
        cases.append(GateCase(kernel=wait_flag_kernel,
                              signature={"flag_ptr": "*i32", "value": "i32", "max_polls": "i32"},
                              constexprs={}, capability=capability, label="wait_flag", num_warps=1))
    return cases
