"""NUMA topology and CPU partitions for the CPU experts (no torch or numba here).

Contract:
- `discover_nodes` reads `node*/cpulist` under a sysfs directory and returns the NUMA nodes restricted to the
  CPUs this process may run on (`os.sched_getaffinity`); nodes left without CPUs are dropped. Without NUMA
  information (containers, non-Linux) it returns a single node 0 holding every allowed CPU.
- `make_partitions` turns nodes into the partitions the experts operator splits its work over: one per node by
  default, or exactly `numa_partitions` of them on any machine (contiguous CPU groups; CPUs are shared
  round-robin when there are more partitions than CPUs, so every partition has at least one CPU).
- `rank_nodes` gives tensor-parallel rank r of n its share of the nodes: with at least n nodes, nodes r, r + n, ...;
  with fewer, its contiguous n-th of every node's CPUs (shared round-robin on a node with fewer CPUs than ranks).
  The rank then makes its partitions from them (`make_partitions`) and runs its kernels on their CPUs
  (`node_cpus`), so the ranks' CPU sets are disjoint wherever the machine has a CPU per rank.
- `rank_cpus` splits a rank's CPUs into the CPU experts' (kernel threads) and the rank's host threads' (the thread
  that steps it: receives the step, prepares inputs, launches the graph; gloo's and NCCL's threads): the last CPU
  of its share where asked and the share has two or more, else the whole share for both.
- `split_dim` cuts [0, size) into `num_parts` ordered contiguous slices whose inner boundaries are multiples of
  `align` (or equal `size`, for empty trailing slices), as equal as possible.
- `pin_current_thread` pins the calling thread where the OS supports it and is a no-op elsewhere (`pinned_thread`:
  for a while; `thread_cpus`: where it may run now).
- `set_worker_spin` bounds how long the kernels' idle pool threads busy-wait before they sleep.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from cpu_experts import compile_cache

_NODE_DIR = re.compile(r"node(\d+)")


@dataclass(frozen=True)
class NumaNode:
    id: int
    cpus: tuple[int, ...]


@dataclass(frozen=True)
class Partition:
    index: int
    node: int | None
    cpus: tuple[int, ...]


def parse_cpulist(text: str) -> tuple[int, ...]:
    """Parse a kernel cpulist such as "0-3,8-11" (blank = no CPUs) into sorted unique CPU ids."""
    cpus: set[int] = set()
    for item in text.strip().split(","):
        item = item.strip()
        if not item:
            continue
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if match is None:
            raise ValueError(f"malformed cpulist {text.strip()!r}: cannot parse {item!r}")
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last < first:
            raise ValueError(f"malformed cpulist {text.strip()!r}: range {item!r} is reversed")
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def allowed_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on; every CPU where the OS has no affinity API."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:
        return tuple(range(os.cpu_count() or 1))


def physical_cores(cpus: Iterable[int], sysfs: str | Path = "/sys/devices/system/cpu") -> int:
    """How many physical cores `cpus` span (SMT siblings count once, from each CPU's `topology/core_cpus_list`,
    older kernels' `thread_siblings_list`); each CPU its own core where sysfs does not say."""
    cores = set()
    for cpu in cpus:
        topology = Path(sysfs) / f"cpu{cpu}" / "topology"
        path = next((topology / name for name in ("core_cpus_list", "thread_siblings_list")
                     if (topology / name).is_file()), None)
        try:
            cores.add(parse_cpulist(path.read_text()) if path is not None else (cpu,))
        except (OSError, ValueError):
            cores.add((cpu,))
    return len(cores)


def discover_nodes(
    sysfs: str | Path = "/sys/devices/system/node", allowed: Iterable[int] | None = None
) -> list[NumaNode]:
    """NUMA nodes (sorted by id) restricted to the allowed CPUs (default: this process's affinity)."""
    allowed_set = set(allowed_cpus() if allowed is None else allowed)
    if not allowed_set:
        raise ValueError("no CPUs are allowed for this process")
    root = Path(sysfs)
    entries = []
    if root.is_dir():
        for child in root.iterdir():
            match = _NODE_DIR.fullmatch(child.name)
            if match and (child / "cpulist").is_file():
                entries.append((int(match.group(1)), child / "cpulist"))
    nodes = []
    for node_id, path in sorted(entries):
        try:
            cpus = parse_cpulist(path.read_text())
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc
        cpus = tuple(cpu for cpu in cpus if cpu in allowed_set)
        if cpus:
            nodes.append(NumaNode(node_id, cpus))
    # No usable NUMA information (no sysfs, or the affinity lies outside every listed node): one flat node.
    return nodes or [NumaNode(0, tuple(sorted(allowed_set)))]


def make_partitions(nodes: list[NumaNode], num_partitions: int | None = None) -> list[Partition]:
    """One partition per node (None or len(nodes)), else `num_partitions` contiguous groups of all nodes' CPUs."""
    if not nodes:
        raise ValueError("make_partitions needs at least one NUMA node")
    if num_partitions is not None and (
        isinstance(num_partitions, bool) or not isinstance(num_partitions, int) or num_partitions < 1
    ):
        raise ValueError(f"numa_partitions must be a positive integer or None, got {num_partitions!r}")
    if num_partitions is None or num_partitions == len(nodes):
        return [Partition(i, node.id, node.cpus) for i, node in enumerate(nodes)]
    node_of = {}
    order = []
    for node in nodes:
        for cpu in node.cpus:
            node_of.setdefault(cpu, node.id)
            order.append(cpu)
    if num_partitions > len(order):
        # Oversubscribed on purpose (e.g. testing N partitions on a small machine): share CPUs round-robin.
        groups = [(order[i % len(order)],) for i in range(num_partitions)]
    else:
        groups = [tuple(order[start:end]) for start, end in split_dim(len(order), num_partitions)]
    return [Partition(i, node_of[group[0]], group) for i, group in enumerate(groups)]


def rank_nodes(nodes: list[NumaNode], rank: int = 0, num_ranks: int = 1) -> list[NumaNode]:
    """The NUMA nodes, or parts of nodes, that tensor-parallel rank `rank` of `num_ranks` drives (module docstring);
    one rank: `nodes` themselves. Call it on the machine's nodes (`discover_nodes` before any rank pins itself)."""
    if not nodes:
        raise ValueError("rank_nodes needs at least one NUMA node")
    check_rank(rank, num_ranks)
    if len(nodes) >= num_ranks:
        return list(nodes[rank::num_ranks])
    shares = []
    for node in nodes:
        if len(node.cpus) < num_ranks:  # oversubscribed on purpose (e.g. tp=3 on a 2-CPU test machine)
            shares.append(NumaNode(node.id, (node.cpus[rank % len(node.cpus)],)))
            continue
        start, end = split_dim(len(node.cpus), num_ranks)[rank]
        shares.append(NumaNode(node.id, node.cpus[start:end]))
    return shares


def check_rank(rank: int, num_ranks: int) -> None:
    """A tensor-parallel rank `rank` of `num_ranks`, as plain ints, or a ValueError naming the bad one."""
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks must be a positive integer, got {num_ranks!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_ranks:
        raise ValueError(f"rank must be an integer in [0, {num_ranks}), got {rank!r}")


@dataclass(frozen=True)
class RankCpus:
    """A tensor-parallel rank's share of the nodes (`rank_nodes`) and its CPUs: its CPU experts' threads on
    `kernels`, its host threads on `host`."""

    nodes: tuple[NumaNode, ...]
    kernels: tuple[int, ...]
    host: tuple[int, ...]


def rank_cpus(nodes: list[NumaNode], rank: int = 0, num_ranks: int = 1, leave_host_cpu: bool = True) -> RankCpus:
    """Rank `rank`'s share of the nodes' CPUs (`rank_nodes`), its last CPU kept for the rank's host threads where
    `leave_host_cpu` and the share has another (module docstring): pinned kernel threads that spin on every CPU of
    the share make the thread that steps the rank wait for a time slice."""
    share = tuple(rank_nodes(nodes, rank, num_ranks))
    cpus = node_cpus(list(share))
    if leave_host_cpu and len(cpus) > 1:
        return RankCpus(share, cpus[:-1], cpus[-1:])
    return RankCpus(share, cpus, cpus)


def node_cpus(nodes: list[NumaNode]) -> tuple[int, ...]:
    """Every CPU of `nodes`, sorted: a rank's CPU set (`rank_nodes`)."""
    return tuple(sorted({cpu for node in nodes for cpu in node.cpus}))


def split_dim(size: int, num_parts: int, align: int = 1) -> list[tuple[int, int]]:
    """Split [0, size) into `num_parts` ordered (start, end) slices with inner boundaries on multiples of `align`.

    Whole `align` blocks are shared out as evenly as possible (earlier slices take the spare blocks) and the
    last slice also takes the tail of `size % align`. With fewer blocks than parts, each leading slice gets one
    block (the last of them possibly partial) and the trailing slices are empty at `size`.
    """
    if size < 0 or num_parts < 1 or align < 1:
        raise ValueError(f"split_dim needs size >= 0, num_parts >= 1, align >= 1; got {size}, {num_parts}, {align}")
    blocks = size // align
    if blocks >= num_parts:
        base, extra = divmod(blocks, num_parts)
        counts = [base + (1 if i < extra else 0) for i in range(num_parts)]
    else:
        units = -(-size // align)  # a partial trailing block counts as a unit here
        counts = [1 if i < units else 0 for i in range(num_parts)]
    slices = []
    start = 0
    for i, count in enumerate(counts):
        end = size if i == num_parts - 1 else min(start + count * align, size)
        slices.append((start, end))
        start = end
    return slices


def thread_cpus() -> tuple[int, ...] | None:
    """The CPUs the calling thread may run on (Linux: pid 0 is the calling thread); None where unsupported."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (OSError, AttributeError):
        return None


@contextmanager
def pinned_thread(cpus: Iterable[int] | None):
    """The calling thread pinned to `cpus` inside (threads it starts meanwhile inherit them), as it was after."""
    previous = thread_cpus()
    is_pinned = pin_current_thread(cpus)
    try:
        yield
    finally:
        if is_pinned and previous is not None:
            pin_current_thread(previous)


def pin_current_thread(cpus: Iterable[int] | None) -> bool:
    """Pin the calling thread to `cpus` (Linux: pid 0 is the calling thread); False where unsupported or empty."""
    cpu_set = set(cpus or ())
    if not cpu_set:
        return False
    try:
        os.sched_setaffinity(0, cpu_set)
    except (OSError, AttributeError):
        return False
    return True


# How an idle thread of the kernels' pool (numba's OpenMP layer, GNU libgomp) waits for the next kernel. With
# libgomp's defaults a small-expert decode call (qwen3 int8, 1 token) took 543 us on the 16-core Xeon, with
# OMP_WAIT_POLICY=ACTIVE 522 us (six interleaved runs each; GOMP_SPINCOUNT alone changed nothing: libgomp spins
# only 100 times whenever it counts more threads than CPUs, as with torch's and numba's pools in one process, and
# 1000 under ACTIVE). Without oversubscription ACTIVE would spin for ever; GOMP_SPINCOUNT bounds that to ~10-70 ms
# (PAUSE takes 10-140 cycles), so the workers still sleep soon after the engine goes idle.
WORKER_SPIN_COUNT = 1_000_000


def set_worker_spin(spin_count: int = WORKER_SPIN_COUNT) -> None:
    """The process-wide settings of the kernels, applied once before the first kernel runs: the worker threads' spin
    (libgomp reads it when numba starts its pool; torch's pool has read it already and keeps its defaults; values
    already in the environment win), and numba's cache dropped if the kernels' sources changed since it was written
    (`compile_cache`). Call after importing torch."""
    compile_cache.refresh()
    os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")
    os.environ.setdefault("GOMP_SPINCOUNT", str(spin_count))


def use_kernel_threads(num_threads: int | None) -> None:
    """Run the numba kernels with `num_threads` threads; None leaves numba's default (every CPU).

    The engine on CUDA leaves one CPU to the thread that drives the GPU: with every CPU busy in a kernel, or
    spinning after one (`set_worker_spin`), that thread's launches and copies wait for a time slice, which made
    eager decode steps several times the experts' own time. Masking threads (`numba.set_num_threads`, per
    launching thread) is not enough: the masked pool thread still spins; on the 16-core Xeon a 2-layer Qwen3-30B
    decode call took 0.59 ms with 15 of 16 threads masked and 0.44 ms with a pool of 15. So before numba's pool
    starts its size is set (numba reads it from `parallel.NUM_THREADS` when it launches the pool; the public
    route, NUMBA_NUM_THREADS, is read at import); after that, masking is the fallback."""
    if num_threads is None:
        return
    import numba
    from numba.np.ufunc import parallel

    num_threads = max(1, num_threads)
    if not parallel._is_initialized and num_threads < numba.config.NUMBA_NUM_THREADS:
        numba.config.NUMBA_NUM_THREADS = parallel.NUM_THREADS = num_threads
    numba.set_num_threads(min(num_threads, numba.config.NUMBA_NUM_THREADS))
