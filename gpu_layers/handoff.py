"""Device side of the CPU-experts hand-off inside CUDA graphs: one-thread kernels that post a value to an int32
flag in page-locked host memory and that wait, on the GPU, until the CPU has posted one back.

Data flow: `post_flag(flag, value)` stores value into flag[0] (host memory the CPU polls); `wait_flag(flag,
value, max_polls)` spins on volatile reads of flag[0] until it equals value (or `max_polls` reads have gone by,
so a dead CPU side cannot hang the GPU forever), then stores 0 there: each value is consumed once. Both take a
flag tensor that is pinned host memory (reached through its mapped device address) or device memory (tests).
The reference is `post_flag_reference` / `wait_flag_reference`, the same steps on the host.

Around the flags, the staged rows cross in one kernel each way (pinned buffers read and written through their
mapped device addresses, no copy-engine nodes): `stage_tokens` writes a MoE layer's hidden [T, H], topk_ids
[T, K] and topk_weights [T, K] into the CPU's buffers, converting dtypes (ids to int64, hidden to the buffer's
dtype) and routing the rows that `valid_rows` marks invalid nowhere (ids -1); `fetch_rows` copies the CPU's output
rows back into a device tensor of the activation dtype. The flags stay kernels of their own: the kernel boundary
orders a stage's writes before the request flag's, and the done flag's wait before the fetch's reads, as the
copies they replace were ordered. References: `stage_tokens_reference`, `fetch_rows_reference`.

Why a kernel and not a host node: the wait runs on the GPU, so a replayed graph needs no host callback (no GIL,
no driver callback thread) between the CPU finishing a layer and the GPU going on.
"""

from __future__ import annotations

import os
import time

import torch
import triton
import triton.language as tl

from gpu_layers.capability import CAPABILITIES, GateCase

# Volatile reads of host memory take about a microsecond over PCIe: 2^28 of them is minutes, far beyond any layer.
DEFAULT_MAX_POLLS = 1 << 28
DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
ID_DTYPES = {torch.int32: "i32", torch.int64: "i64"}
# Row chunk per program of the copy kernels: 8 elements a thread over 4 warps; top-k up to 16 in one program.
BLOCK_H, BLOCK_K, ROW_WARPS = 1024, 16, 4


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


@triton.jit
def stage_tokens_kernel(
    hidden_ptr, ids_ptr, weights_ptr, valid_ptr, hidden_dst_ptr, ids_dst_ptr, weights_dst_ptr,
    hidden_row_stride, hidden_size, top_k, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program (row, chunk): BLOCK_H columns of hidden row `row`; chunk 0 also writes the row's ids and weights."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    x = tl.load(hidden_ptr + row * hidden_row_stride + cols, mask=cols < hidden_size)
    tl.store(hidden_dst_ptr + row * hidden_size + cols, x.to(hidden_dst_ptr.dtype.element_ty),
             mask=cols < hidden_size)
    if tl.program_id(1) == 0:
        slots = tl.arange(0, BLOCK_K)
        is_slot = slots < top_k
        ids = tl.load(ids_ptr + row * top_k + slots, mask=is_slot).to(tl.int64)
        is_valid = tl.load(valid_ptr + row) != 0
        tl.store(ids_dst_ptr + row * top_k + slots, tl.where(is_valid, ids, -1), mask=is_slot)
        weights = tl.load(weights_ptr + row * top_k + slots, mask=is_slot)
        tl.store(weights_dst_ptr + row * top_k + slots, weights.to(tl.float32), mask=is_slot)


@triton.jit
def fetch_rows_kernel(src_ptr, dst_ptr, hidden_size, BLOCK_H: tl.constexpr):
    """dst [T, H] = src [T, H] (both contiguous), cast to dst's dtype; program (row, chunk)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    x = tl.load(src_ptr + row * hidden_size + cols, mask=cols < hidden_size)
    tl.store(dst_ptr + row * hidden_size + cols, x.to(dst_ptr.dtype.element_ty), mask=cols < hidden_size)


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


def _check_buffer(name: str, buffer: torch.Tensor, shape: tuple, dtypes) -> None:
    if tuple(buffer.shape) != shape or buffer.dtype not in dtypes or not buffer.is_contiguous():
        raise ValueError(f"{name} must be contiguous {shape} of {[str(d) for d in dtypes]}, got "
                         f"{tuple(buffer.shape)} {buffer.dtype}")
    if not (buffer.is_cuda or buffer.is_pinned() or _is_interpreted(buffer)):
        raise ValueError(f"{name} must be CUDA memory or page-locked host memory (pin_memory=True)")


def _is_interpreted(t: torch.Tensor) -> bool:
    """CPU tensors are fine under Triton's interpreter (the tests), where every buffer is host memory."""
    return t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def stage_tokens(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 valid_rows: torch.Tensor, hidden_dst: torch.Tensor, ids_dst: torch.Tensor,
                 weights_dst: torch.Tensor) -> None:
    """On the current stream: hidden [T, H] (rows contiguous) -> hidden_dst [T, H] (any float dtype), topk_ids
    [T, K] int32/int64 -> ids_dst int64 [T, K] (-1 on the rows where valid_rows [T] or [T, 1] bool is False),
    topk_weights [T, K] float32 -> weights_dst float32 [T, K]."""
    if hidden.dim() != 2 or hidden.stride(-1) != 1 or hidden.dtype not in DTYPES:
        raise ValueError(f"hidden must be [T, H] with contiguous rows in one of {list(DTYPES)}, got "
                         f"{tuple(hidden.shape)} {hidden.dtype} strides {hidden.stride()}")
    (num_tokens, hidden_size), top_k = hidden.shape, topk_ids.shape[-1] if topk_ids.dim() == 2 else 0
    if not 1 <= top_k <= BLOCK_K:
        raise ValueError(f"topk_ids must be [T, K] with 1 <= K <= {BLOCK_K}, got {tuple(topk_ids.shape)}")
    _check_buffer("topk_ids", topk_ids, (num_tokens, top_k), ID_DTYPES)
    _check_buffer("topk_weights", topk_weights, (num_tokens, top_k), (torch.float32,))
    if valid_rows.dtype != torch.bool or valid_rows.numel() != num_tokens or not valid_rows.is_contiguous():
        raise ValueError(f"valid_rows must be contiguous bool with {num_tokens} elements, got "
                         f"{tuple(valid_rows.shape)} {valid_rows.dtype}")
    _check_buffer("hidden_dst", hidden_dst, (num_tokens, hidden_size), DTYPES)
    _check_buffer("ids_dst", ids_dst, (num_tokens, top_k), (torch.int64,))
    _check_buffer("weights_dst", weights_dst, (num_tokens, top_k), (torch.float32,))
    if num_tokens == 0:
        return
    stage_tokens_kernel[(num_tokens, triton.cdiv(hidden_size, BLOCK_H))](
        hidden, topk_ids, topk_weights, valid_rows.view(torch.uint8), hidden_dst, ids_dst, weights_dst,
        hidden.stride(0), hidden_size, top_k, BLOCK_H=BLOCK_H, BLOCK_K=BLOCK_K, num_warps=ROW_WARPS)


def fetch_rows(src: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """On the current stream: src [T, H] (contiguous, pinned or device) -> a new [T, H] tensor of `dtype` on
    `device`."""
    if src.dim() != 2 or src.dtype not in DTYPES or dtype not in DTYPES:
        raise ValueError(f"src must be [T, H] of {list(DTYPES)} and dtype one of them, got {tuple(src.shape)} "
                         f"{src.dtype} -> {dtype}")
    _check_buffer("src", src, tuple(src.shape), DTYPES)
    out = torch.empty(src.shape, dtype=dtype, device=device)
    if src.numel():
        fetch_rows_kernel[(src.shape[0], triton.cdiv(src.shape[1], BLOCK_H))](
            src, out, src.shape[1], BLOCK_H=BLOCK_H, num_warps=ROW_WARPS)
    return out


def stage_tokens_reference(hidden, topk_ids, topk_weights, valid_rows, hidden_dst, ids_dst, weights_dst) -> None:
    """What the graph hand-off did with separate ops: mask the ids of invalid rows, then three copies."""
    hidden_dst.copy_(hidden)
    ids_dst.copy_(topk_ids.long().masked_fill(~valid_rows.reshape(-1, 1), -1))
    weights_dst.copy_(topk_weights)


def fetch_rows_reference(src: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return src.to(device=device, dtype=dtype, copy=True)


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
        for src in DTYPES.values():
            for dst in sorted({src, "fp32"}):
                cases.append(GateCase(kernel=fetch_rows_kernel,
                                      signature={"src_ptr": f"*{dst}", "dst_ptr": f"*{src}", "hidden_size": "i32",
                                                 "BLOCK_H": "constexpr"},
                                      constexprs={"BLOCK_H": BLOCK_H}, capability=capability,
                                      label=f"fetch_rows {dst}->{src}", num_warps=ROW_WARPS))
                for ids in ID_DTYPES.values():
                    cases.append(GateCase(
                        kernel=stage_tokens_kernel,
                        signature={"hidden_ptr": f"*{src}", "ids_ptr": f"*{ids}", "weights_ptr": "*fp32",
                                   "valid_ptr": "*u8", "hidden_dst_ptr": f"*{dst}", "ids_dst_ptr": "*i64",
                                   "weights_dst_ptr": "*fp32", "hidden_row_stride": "i32", "hidden_size": "i32",
                                   "top_k": "i32", "BLOCK_H": "constexpr", "BLOCK_K": "constexpr"},
                        constexprs={"BLOCK_H": BLOCK_H, "BLOCK_K": BLOCK_K}, capability=capability,
                        label=f"stage_tokens {src}->{dst} ids {ids}", num_warps=ROW_WARPS))
    return cases
