"""Each tensor-parallel rank's own numbers for the server's metrics: forward passes run, the seconds its CPU experts
computed (each rank drives its own slice of them on its own CPUs), its GPU's memory, and whether its process lives.

How they reach rank 0, and why so: every rank publishes its row of one `RankTable` at the end of each of its steps,
from the thread that steps it (`ModelRunner.finish_step`); at tensor parallel the table is shared memory that rank 0
created before it spawned the others (`multiprocessing.RawArray`, handed over with `hybrid.parallel.init`), so a
scrape on rank 0 reads every rank's latest row at any time, from any thread, without a collective, a lock the engine
takes, a pipe that could fill while nobody scrapes, or anything that waits for a worker. A collective issued for
metrics would have to be ordered among the engine thread's step broadcasts (a scrape from the HTTP thread must never
issue one) and would wait for the slowest rank; a pushed message needs a reader that keeps up. A row costs a few
stores per step. Each value is one aligned 8-byte store, so a read sees every value whole; a row read during a
publish may mix two consecutive steps' values, which counters and gauges tolerate. Whether a worker lives is rank 0's
own check of its process's sentinel (a file descriptor: no waitpid that could race the engine thread's `check`).

GPU memory is sampled at most every `MEMORY_SAMPLE_SECONDS` (torch's allocator statistics cost more than the
stores), at build and then at the end of a step; the counters at every step.
"""

from __future__ import annotations

import math
import time
from array import array
from dataclasses import dataclass
from multiprocessing.sharedctypes import RawArray

import torch

MEMORY_SAMPLE_SECONDS = 1.0
FIELDS = ("num_steps", "cpu_experts_seconds", "gpu_allocated_bytes", "gpu_reserved_bytes")


@dataclass(frozen=True)
class RankStats:
    """One rank's numbers: forward passes it ran, seconds its CPU experts computed (both since it started), its
    device's memory (torch's allocator: allocated and reserved bytes; None on a CPU device), whether it lives."""

    rank: int
    is_alive: bool
    num_steps: int
    cpu_experts_seconds: float
    gpu_allocated_bytes: float | None
    gpu_reserved_bytes: float | None


class RankTable:
    """Every rank's latest row of `FIELDS` (module docstring); `is_shared`: in shared memory, for ranks in other
    processes (pickled only while they are spawned); else a plain array (one rank)."""

    def __init__(self, size: int, is_shared: bool):
        zeros = [0.0] * (size * len(FIELDS))
        self.size = size
        self._values = RawArray("d", zeros) if is_shared else array("d", zeros)

    def publish(self, rank: int, num_steps: int, cpu_experts_seconds: float, memory: tuple[float, float] | None):
        """Rank `rank`'s row; `memory`: (allocated, reserved) bytes, or None: unchanged."""
        start = rank * len(FIELDS)
        self._values[start] = num_steps
        self._values[start + 1] = cpu_experts_seconds
        if memory is not None:
            self._values[start + 2], self._values[start + 3] = memory

    def read(self, rank: int, is_alive: bool) -> RankStats:
        start = rank * len(FIELDS)
        steps, seconds, allocated, reserved = self._values[start:start + len(FIELDS)]
        return RankStats(rank, is_alive, int(steps), seconds, None if math.isnan(allocated) else allocated,
                         None if math.isnan(reserved) else reserved)


class RankCounters:
    """This rank's counters, kept by the thread that steps it, and their publication into the rank's row.

    The CPU experts' seconds come from cumulative totals of several sources (the model's executor, which every eager
    step of any runner uses, and each graph runner's flag worker and decode pool); each source's total is counted
    once, by what it added since it was last seen, whichever runner looks (`add_cpu_seconds`), so the shared executor
    is not counted twice and a decode pool's last layer, added just after its step, is counted at the next one."""

    def __init__(self, table: RankTable, rank: int, device: str):
        self.table, self.rank = table, rank
        self.device = torch.device(device)
        self.num_steps = 0
        self.cpu_experts_seconds = 0.0
        self._seen: dict[object, float] = {}  # source -> its total counted so far
        self._memory_sampled_at = -math.inf

    def add_cpu_seconds(self, sources) -> None:
        """Adds what each source (an object with a cumulative `compute_seconds`) computed since it was last seen."""
        for source in sources:
            total = source.compute_seconds
            self.cpu_experts_seconds += total - self._seen.get(source, 0.0)
            self._seen[source] = total

    def forget(self, sources) -> None:
        """Sources going away (a graph runner closing), counted one last time."""
        self.add_cpu_seconds(sources)
        for source in sources:
            self._seen.pop(source, None)

    def publish(self) -> None:
        now = time.monotonic()
        memory = None
        if now - self._memory_sampled_at >= MEMORY_SAMPLE_SECONDS:
            self._memory_sampled_at = now
            memory = (math.nan, math.nan)
            if self.device.type == "cuda":
                memory = (torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device))
        self.table.publish(self.rank, self.num_steps, self.cpu_experts_seconds, memory)


def cpu_seconds_by_rank(table: RankTable, num_steps: int, timeout: float = 2.0) -> tuple[float, ...]:
    """Each rank's CPU-experts seconds so far, read once every rank has published `num_steps` steps (rank 0's own
    count: the other ranks publish theirs just after it, at the end of the same step), or after `timeout` seconds
    (a rank behind: its latest row). What `hybrid-bench` reads around its timed steps, from outside the ranks."""
    deadline = time.monotonic() + timeout
    while (any(table.read(r, True).num_steps < num_steps for r in range(table.size))
           and time.monotonic() < deadline):
        time.sleep(1e-4)
    return tuple(table.read(r, True).cpu_experts_seconds for r in range(table.size))
