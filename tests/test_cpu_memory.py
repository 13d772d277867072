"""cpu_experts.memory: expert buffers start on a 2 MiB boundary and, where the kernel's transparent huge pages honour
`madvise`, are backed by 2 MiB pages once written (the decode kernels stream them; 4 KiB pages cost a TLB miss and
a prefetcher stop every 4 KiB)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from cpu_experts import memory

THP = Path("/sys/kernel/mm/transparent_hugepage")


def _selected(path: Path) -> str | None:
    """The bracketed choice of a sysfs setting such as `always [madvise] never`."""
    try:
        match = re.search(r"\[([\w+]+)\]", path.read_text())
    except OSError:
        return None
    return match[1] if match else None


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside, huge = False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head[1], 16) <= address < int(head[2], 16)
        elif inside and line.startswith("AnonHugePages:"):
            huge += int(line.split()[1])
    return huge


@pytest.mark.parametrize(("shape", "dtype"), [((3, 1 << 20), np.uint8), ((5, 1333, 1001), np.int8),
                                              ((2, 1 << 19), np.float32)])
def test_large_buffers_start_on_a_huge_page(shape, dtype):
    array = memory.empty(shape, dtype)
    assert array.shape == shape and array.dtype == dtype and array.flags.c_contiguous
    assert array.ctypes.data % memory.HUGE_PAGE == 0
    array[...] = 7  # the whole extent is writable
    assert int(array.reshape(-1)[-1]) == 7


def test_small_buffers_are_plain_and_tensors_keep_their_dtype():
    assert memory.empty((100,), np.int8).nbytes == 100
    tensor = memory.empty_tensor((4, 1 << 19), torch.bfloat16)
    assert tensor.dtype == torch.bfloat16 and tensor.shape == (4, 1 << 19)
    assert tensor.data_ptr() % memory.HUGE_PAGE == 0
    source = np.arange(3 << 20, dtype=np.int16).reshape(3, -1)
    copied = memory.copy(source)
    assert np.array_equal(copied, source) and copied.ctypes.data % memory.HUGE_PAGE == 0


@pytest.mark.skipif(_selected(THP / "enabled") not in ("always", "madvise")
                    or _selected(THP / "defrag") not in ("always", "defer+madvise", "madvise"),
                    reason="this kernel's transparent huge pages do not serve madvise'd faults")
def test_written_buffers_are_backed_by_huge_pages():
    array = memory.empty((16 << 20,), np.uint8)
    array[:] = 1  # first touch faults the pages in
    huge_kib = _anon_huge_kib(array.ctypes.data)
    assert huge_kib >= 8 << 10, f"only {huge_kib} KiB of 16 MiB in huge pages"
