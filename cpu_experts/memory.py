"""Memory for the expert weights: 2 MiB-aligned anonymous mappings advised for transparent huge pages.

The decode kernels stream gigabytes of weights per second; with 4 KiB pages every 4 KiB of a stream costs a TLB
miss and the hardware prefetchers stop at each page edge. On Linux with THP in `madvise` or `always` mode these
buffers get 2 MiB pages; elsewhere they are ordinary memory. Pages are placed on the NUMA node of the thread
that first writes them (Linux first-touch), so callers fill a partition's buffers from that node's threads.
"""

from __future__ import annotations

import mmap

import numpy as np
import torch

HUGE_PAGE = 2 << 20


def empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts on a 2 MiB boundary, advised for huge pages."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < HUGE_PAGE:
        return np.empty(shape, dtype)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(region, dtype=np.uint8)  # keeps `region` alive as its base
    skip = -raw.ctypes.data % HUGE_PAGE
    return raw[skip:skip + nbytes].view(dtype).reshape(shape)


def empty_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`empty` as a torch tensor (bf16 through uint16 storage, which numpy lacks)."""
    if dtype == torch.bfloat16:
        return torch.from_numpy(empty(shape, np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(empty(shape, torch.empty((), dtype=dtype).numpy().dtype))


def copy(src: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of `src` in `empty` memory."""
    out = empty(src.shape, src.dtype)
    np.copyto(out, src)
    return out
