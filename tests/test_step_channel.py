"""The tensor-parallel step channel (`hybrid.step_channel`): one writer's messages reach every reader whole and in
order through a ring of few, small slots (messages larger than a slot in chunks), the writer waits for the slowest
reader instead of overwriting a slot it has not read, and a dead reader or writer is an error on the other side,
not a wait for ever. Readers and writers in other processes (spawn, as the ranks are started)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from multiprocessing.connection import wait
from pathlib import Path

import pytest

from hybrid.step_channel import ChannelClosed, StepChannel

# ints, tuples of a step's shape, and payloads of 0.5 to 40 slots (the slots are 64 bytes)
MESSAGES = [i if i % 3 else ("execute", i, list(range(i % 17)), b"x" * (i * 13 % 2600)) for i in range(300)]


def _read_all(channel: StepChannel, reader: int, count: int, is_slow: bool, out) -> None:
    got = []
    for i in range(count):
        got.append(channel.read(reader))
        if is_slow and i % 7 == 0:
            time.sleep(0.002)  # the ring fills: the writer must wait for this reader
    out.send(got)


def _write_some(channel: StepChannel, messages: list) -> None:
    for message in messages:
        channel.write(message)


def _read_until_closed(channel: StepChannel, result: str) -> None:
    """A worker's wait for its next command (`hybrid.tp_workers.serve`), its rank 0 gone meanwhile."""
    from hybrid.tp_workers import parent_alive

    try:
        channel.read(0, parent_alive())
    except ChannelClosed as exc:  # written whole, then renamed: the test polls for the name
        Path(result + ".part").write_text(str(exc))
        Path(result + ".part").rename(result)


def _start_reader_and_die(channel: StepChannel, result: str) -> None:
    _spawn(_read_until_closed, channel, result)
    time.sleep(0.5)
    os._exit(0)  # as a killed rank 0: no clean-up of its children


def _spawn(target, *args, daemon: bool = True) -> mp.Process:
    process = mp.get_context("spawn").Process(target=target, args=args, daemon=daemon)
    process.start()
    return process


def test_one_process_order_and_a_full_ring():
    channel = StepChannel(1, slot_bytes=64, num_slots=2)
    channel.write("a")
    channel.write(("b", [1, 2]))

    def full():
        raise TimeoutError("full")

    with pytest.raises(TimeoutError, match="full"):  # both slots unread: the writer waits (and asks check())
        channel.write("c", full)
    assert [channel.read(0), channel.read(0)] == ["a", ("b", [1, 2])]  # nothing overwritten
    channel.write("c" * 100)  # two slots' worth: two chunks
    with pytest.raises(TimeoutError, match="full"):
        channel.write("d", full)
    assert channel.read(0) == "c" * 100
    channel.write("d", full)
    assert channel.read(0) == "d"


def test_many_messages_through_a_small_ring_reach_every_reader_in_order():
    channel = StepChannel(2, slot_bytes=64, num_slots=3)
    pipes = [mp.get_context("spawn").Pipe(duplex=False) for _ in range(2)]
    readers = [_spawn(_read_all, channel, r, len(MESSAGES), r == 1, writer) for r, (_, writer) in enumerate(pipes)]
    for _, writer in pipes:
        writer.close()  # the readers' now: a reader that dies is an EOF here
    alive = []

    def check():  # rank 0's `Workers.check`
        alive.append(all(p.is_alive() for p in readers))
        if not alive[-1]:
            raise RuntimeError("a reader died")

    for message in MESSAGES:
        channel.write(message, check)
    for (reader_end, _), process in zip(pipes, readers, strict=True):
        assert reader_end.poll(60), "a reader did not finish"
        assert reader_end.recv() == MESSAGES
        process.join(10)
    assert alive, "the writer never waited (the ring fills before the readers have started)"


def test_a_dead_reader_is_an_error_in_the_writer():
    channel = StepChannel(1, slot_bytes=64, num_slots=2)
    reader_end, writer_end = mp.get_context("spawn").Pipe(duplex=False)
    reader = _spawn(_read_all, channel, 0, 1, False, writer_end)  # reads one message, then exits

    def check():
        if not reader.is_alive():
            raise RuntimeError("the reader exited")

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="the reader exited"):
        for i in range(10):  # the 4th waits for a slot the dead reader never frees
            channel.write(i, check)
    assert time.monotonic() - start < 30
    assert reader_end.recv() == [0]


def test_a_dead_writer_is_an_error_in_the_reader():
    channel = StepChannel(1, slot_bytes=64, num_slots=2)
    writer = _spawn(_write_some, channel, ["first", "x" * 100])
    assert channel.read(0) == "first"
    assert channel.read(0) == "x" * 100  # two chunks
    writer.join(30)
    start = time.monotonic()
    with pytest.raises(ChannelClosed, match="writer of the step channel exited"):
        channel.read(0, lambda: not wait([writer.sentinel], timeout=0))
    assert time.monotonic() - start < 5


def test_a_worker_whose_rank0_died_exits(tmp_path):
    """A worker waits on its parent's sentinel (`tp_workers.parent_alive`): its rank 0 killed, it stops waiting."""
    result = tmp_path / "result"
    channel = StepChannel(1, slot_bytes=64, num_slots=2)
    _spawn(_start_reader_and_die, channel, str(result), daemon=False).join(60)  # rank 0, which starts a worker
    deadline = time.monotonic() + 60
    while not result.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert result.read_text() == "the writer of the step channel exited"
