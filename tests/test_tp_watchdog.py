"""Rank 0's watchdog over the tensor-parallel workers (`hybrid.tp_workers.Workers._watch`): a worker's death is
logged with its report at once; over NCCL, a rank 0 that has not raised the failure itself within the grace period
ends its process (a collective waiting for a dead rank would block it for good), and one that has raised it, or is
stopping, is left alone. Fake workers: forked processes that report and exit, or are killed."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
from types import SimpleNamespace

import pytest

from hybrid import tp_workers
from hybrid.tp_workers import Workers


def _report_and_exit(writer) -> None:
    writer.send("rank 1 failed: ValueError: planted")
    os._exit(1)


def _sleep_forever() -> None:
    threading.Event().wait()


def fake_workers(target, *, is_cuda: bool) -> Workers:
    """A `Workers` with only what the watchdog reads: one worker process (started) and its report pipe."""
    context = mp.get_context("fork")
    reader, writer = context.Pipe(duplex=False)
    workers = Workers.__new__(Workers)
    workers.processes = [context.Process(target=target, args=(writer,) if target is _report_and_exit else ())]
    workers.reports = [reader]
    workers.is_stopped, workers._is_stopping, workers.is_cuda = False, False, is_cuda
    workers._failures, workers._lock, workers._is_raised = [], threading.Lock(), threading.Event()
    workers.processes[0].start()
    writer.close()
    return workers


@pytest.fixture
def exits(monkeypatch):
    """os._exit replaced: the codes it was called with (the watchdog's thread ends there)."""
    codes = []
    monkeypatch.setattr(tp_workers, "BLOCKED_EXIT_SECONDS", 0.2)
    # the module's os only: the forked workers exit through the real one
    monkeypatch.setattr(tp_workers, "os", SimpleNamespace(_exit=codes.append))
    return codes


def watch(workers: Workers) -> None:
    thread = threading.Thread(target=workers._watch, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()


def test_a_blocked_rank0_over_nccl_exits_after_logging_the_report(exits, caplog):
    workers = fake_workers(_report_and_exit, is_cuda=True)
    with caplog.at_level(logging.ERROR, logger="hybrid.tp_workers"):
        watch(workers)
    assert "rank 1 failed: ValueError: planted" in caplog.text
    assert exits == [1]
    # the report stays for rank 0's own raise
    with pytest.raises(RuntimeError, match="rank 1 failed: ValueError: planted"):
        workers.raise_reported()


def test_a_killed_worker_is_logged_and_gloo_never_exits(exits, caplog):
    workers = fake_workers(_sleep_forever, is_cuda=False)
    workers.processes[0].kill()
    with caplog.at_level(logging.ERROR, logger="hybrid.tp_workers"):
        watch(workers)
    assert "rank 1 exited without a report" in caplog.text
    assert exits == []


def test_no_exit_once_rank0_raised_or_while_stopping(exits, caplog):
    raised = fake_workers(_report_and_exit, is_cuda=True)
    raised._is_raised.set()
    watch(raised)
    stopping = fake_workers(_sleep_forever, is_cuda=True)
    stopping._is_stopping = True
    watch(stopping)  # returns while the worker still runs
    stopping.processes[0].kill()
    stopping.processes[0].join()
    raised.processes[0].join()
    assert exits == []
