"""Rank 0's commands to the other tensor-parallel ranks through shared memory: one writer, a few readers, in order.

Why not a gloo broadcast: `broadcast_object_list` is two collectives over TCP (the size, then the bytes) per step,
each a round trip through the kernel's sockets and gloo's threads, and it waits for every rank to join it; on the
H200 pair a tp=2 decode step spent several times the all-reduces' own time outside the GPU's work. Here rank 0
writes a step's pickled command into shared memory and goes on; a worker spinning on the slot sees it within
microseconds. (vLLM's shared-memory message queue works so; this one is ours and small.)

Layout: a ring of `num_slots` slots of `slot_bytes` each, and a control array of 8-byte integers: per slot the
sequence number of the message chunk it holds and the message's size in bytes; per reader the sequence number of
the last chunk it has read. Chunk n (numbered from 1, one writer) goes into slot (n - 1) % num_slots, only after
every reader has read chunk n - num_slots (the slot's previous content): the writer never overwrites what a reader
has not read. The writer stores the payload, then the size, then the sequence number; a reader that sees its next
sequence number in the slot reads the size and the payload, then stores its own read counter. Each integer is one
aligned 8-byte store, and x86 keeps stores, and loads, in program order, so a reader that sees the number sees
the payload written before it (an ARM host would need fences here).

A message larger than a slot goes through the ring in slot-sized chunks, one after another (the readers take each
as it comes, so any size passes through any ring); a step's command fits one slot at the default size.

Waiting: a reader spins (`os.sched_yield`: the GIL and the CPU are offered to other threads at every turn) for
`SPIN_SECONDS`, then sleeps, each sleep longer up to `MAX_SLEEP_SECONDS`, so an idle worker holds no CPU;
while it waits it asks `is_writer_alive()` now and then and raises `ChannelClosed` when the writer is gone. The
writer waits only where the ring is full, spinning the same way and calling `check()` (which raises where a
reader died) now and then.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import time
from collections.abc import Callable
from multiprocessing.sharedctypes import RawArray

SLOT_BYTES = 256 << 10  # a prefill chunk of 8192 tokens' ids pickles to ~40 KB
NUM_SLOTS = 4
SPIN_SECONDS = 0.05  # longer than a decode step's host gap: a stepping worker never sleeps between steps
MAX_SLEEP_SECONDS = 1e-3  # what the first step after an idle stretch may wait for a sleeping worker
CHECK_SECONDS = 0.01  # how often a waiting side asks whether the other lives


class ChannelClosed(RuntimeError):
    """The other side of the channel is gone (its process died)."""


def _never(*_) -> None:
    return None


# releases the GIL and offers the CPU to another runnable thread (time.sleep(0) returns at once on Linux)
_yield = getattr(os, "sched_yield", lambda: time.sleep(0))


class StepChannel:
    """One writer's messages to `num_readers` readers (module docstring); pickled only while processes are spawned
    (the arrays are shared memory). Each process keeps its own position: the writer its next chunk, reader r (0 ..
    num_readers - 1) its next chunk to read."""

    def __init__(self, num_readers: int, slot_bytes: int = SLOT_BYTES, num_slots: int = NUM_SLOTS):
        if num_readers < 1 or slot_bytes < 1 or num_slots < 1:
            raise ValueError(f"StepChannel needs num_readers, slot_bytes and num_slots >= 1; got {num_readers}, "
                             f"{slot_bytes}, {num_slots}")
        self.num_readers, self.slot_bytes, self.num_slots = num_readers, slot_bytes, num_slots
        # [slot seq, slot size] * num_slots, then [read seq] * num_readers
        self._control = RawArray(ctypes.c_int64, 2 * num_slots + num_readers)
        self._data = RawArray(ctypes.c_uint8, num_slots * slot_bytes)
        self._next_write = self._next_read = 1  # this process's next chunk to write (the writer) or to read

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_view"}

    @property
    def _bytes(self) -> memoryview:
        view = self.__dict__.get("_view")
        if view is None:
            view = self.__dict__["_view"] = memoryview(self._data).cast("B")
        return view

    def write(self, message, check: Callable[[], None] = _never) -> None:
        """Pickles `message` into the ring (chunk by chunk where it is larger than a slot); waits only while the
        ring is full, calling `check()` now and then (it raises where a reader died)."""
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        size = len(payload)
        for start in range(0, max(size, 1), self.slot_bytes):
            chunk = payload[start:start + self.slot_bytes]
            seq = self._next_write
            self._wait(lambda seq=seq: self._min_read() >= seq - self.num_slots, check)
            slot = (seq - 1) % self.num_slots
            offset = slot * self.slot_bytes
            self._bytes[offset:offset + len(chunk)] = chunk
            self._control[2 * slot + 1] = size
            self._control[2 * slot] = seq  # last: a reader that sees it sees the chunk
            self._next_write = seq + 1

    def read(self, reader: int, is_writer_alive: Callable[[], bool] = lambda: True):
        """Reader `reader`'s next message, waiting for it (module docstring); `ChannelClosed` where
        `is_writer_alive()` turns False while it waits."""

        def check() -> None:
            if not is_writer_alive():
                raise ChannelClosed("the writer of the step channel exited")

        parts, size, received = [], None, 0
        while size is None or received < size:
            seq = self._next_read
            slot = (seq - 1) % self.num_slots
            self._wait(lambda index=2 * slot, seq=seq: self._control[index] >= seq, check)
            if self._control[2 * slot] != seq:
                raise RuntimeError(f"step channel: slot {slot} holds chunk {self._control[2 * slot]} where reader "
                                   f"{reader} expected {seq}: the writer overwrote a chunk before it was read")
            size = self._control[2 * slot + 1]
            length = min(self.slot_bytes, size - received)
            offset = slot * self.slot_bytes
            parts.append(bytes(self._bytes[offset:offset + length]))
            received += length
            self._control[2 * self.num_slots + reader] = seq  # after the copy: the slot is free for the writer
            self._next_read = seq + 1
        return pickle.loads(b"".join(parts))

    def _min_read(self) -> int:
        first = 2 * self.num_slots
        return min(self._control[first:first + self.num_readers])

    @staticmethod
    def _wait(is_ready: Callable[[], bool], check: Callable[[], None]) -> None:
        """Until is_ready(): spins for SPIN_SECONDS, then sleeps longer and longer (up to MAX_SLEEP_SECONDS);
        check() every CHECK_SECONDS."""
        if is_ready():
            return
        start = checked = time.monotonic()
        sleep = 0.0
        while not is_ready():
            if sleep:
                time.sleep(sleep)
            else:
                _yield()
            now = time.monotonic()
            if now - checked >= CHECK_SECONDS:
                check()
                checked = now
            if now - start >= SPIN_SECONDS:
                sleep = min(max(2 * sleep, 5e-5), MAX_SLEEP_SECONDS)
