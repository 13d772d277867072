"""Per-compute-capability kernel configs, and the description of a compile that the SM120 gate checks.

Every Triton kernel module keeps its launch configs in a table keyed by compute capability (89: Ada, 90: Hopper,
120: RTX PRO 6000 Blackwell / RTX 5090), chosen once at run time by `select`. The gate (`gpu_layers.gate`)
compiles each module's `gate_cases()` offline for the capability it belongs to and checks shared memory and
register spills against that target's limits, so a config the runtime can select is proven to fit before it ever
meets a GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

# Shared memory a block may use (bytes, the opt-in maximum): SM120 and Ada have 99 KiB, Hopper 227 KiB.
SHARED_MEMORY_LIMIT = {89: 101376, 90: 232448, 120: 101376}
CAPABILITIES = tuple(SHARED_MEMORY_LIMIT)


@functools.cache
def capability_of(device) -> int:
    """torch device -> 89, 90 or 120: the nearest table at or below the device's capability (SM100/103 use the
    SM90 table only if a kernel's table says so; unknown newer parts fall back to 120's, the smallest limits).
    A CPU device (kernels under Triton's interpreter) gets 120's configs, the ones the tests should exercise."""
    import torch

    if torch.device(device).type != "cuda":
        return 120
    major, minor = torch.cuda.get_device_capability(device)
    cc = 10 * major + minor
    if cc >= 120:
        return 120
    if cc >= 90:
        return 90
    return 89


@functools.cache
def num_sms(device) -> int:
    """Multiprocessors of a CUDA device, which split-K launchers size their grids by; the interpreter (a CPU
    device) plays a GPU of 4, so the small test shapes take the split paths."""
    import torch

    if torch.device(device).type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def select(table: dict[int, Any], capability: int) -> Any:
    """The entry of `table` for `capability`, else the nearest lower one, else the smallest."""
    lower = [cc for cc in table if cc <= capability]
    return table[max(lower)] if lower else table[min(table)]


@dataclass(frozen=True)
class GateCase:
    """One compile the gate checks: `kernel` (a @triton.jit function) with `signature` (argument name -> Triton
    type: "*bf16", "*fp32", "*fp8e4nv", "*i32", "i32", "fp32", "constexpr", ...), the constexpr values, and the
    launch options, for the target `capability`. `label` names it in failures ("rms_norm bf16 H=7168")."""

    kernel: Any
    signature: dict[str, str]
    constexprs: dict[str, Any]
    capability: int
    label: str
    num_warps: int = 4
    num_stages: int = 2
    extra: dict[str, Any] = field(default_factory=dict)  # other compile options, if any
