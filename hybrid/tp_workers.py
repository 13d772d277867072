"""The tensor-parallel ranks' processes: rank 0's `LLM` starts ranks 1..N-1 (torch.multiprocessing, spawn), each
of which builds its own shard of the model from the same path and config and then serves steps until told to stop.

Rank 0 keeps everything that decides (scheduler, engine, KV-page allocator, sampling, the HTTP server); a step
reaches the workers at one place, `ModelRunner.execute`, which writes its sequences, token ids and logit rows into
the step channel (`hybrid.step_channel`: shared memory rank 0 creates before it spawns the others) before it runs,
so every rank runs the same forward pass on the same pages (each rank's KV cache has the same pages, holding its
own heads). A runner that captures CUDA graphs is announced the same way before it captures, so every rank captures
the same buckets in the same order (their collectives captured inside). Every command goes through the channel, in
one order; the host (gloo) group only waits for the workers to be built (`Workers.wait_ready`). Commands, as
tuples:
    ("runner", id, max_graph_batch)            build a graph-capturing runner (and capture)
    ("execute", id or None, seqs, input_ids, logit_rows)   one forward pass (None: the eager runner)
    ("close", id)                              close a graph runner
    ("stop",)                                  leave the loop and exit

Metrics: each rank writes its numbers into its row of a table in shared memory that rank 0 hands to every rank at
spawn (`hybrid.rank_stats`), at the end of each step; rank 0's server reads the rows, and each worker's liveness
from its process's sentinel, without a command or a collective (`Workers.alive`).

Host CPUs (on CUDA): each rank's CPU experts run on its share of the host's CPUs but one (`topology.rank_cpus`);
that one is the rank's host CPU, for the thread that steps the rank (it receives the step, prepares the inputs and
launches the graph: a worker's main thread once its shard is loaded, and rank 0's thread that sends the steps,
pinned at its first, until `stop`) and for gloo's and NCCL's threads (started while the joining thread is pinned
there, they inherit it). A thread started by a pinned one inherits its CPU too (numba's pool, where a pinned
thread runs a kernel itself). Kernel threads that spin on every CPU of a share would make the stepping thread wait
for a time slice. On the CPU device nothing is pinned: the ranks' dense layers compute on their whole share.

Failures: a worker that raises reports its traceback to rank 0 (a pipe) and exits. Rank 0 sees it before its next
command (the worker's process sentinel, `Workers.check`), while it waits for room in the channel, or in the step's
collectives, which fail at once over gloo (a dead process closes its sockets); it then raises the worker's error
(`Workers.raise_reported`). A worker whose rank 0 died sees its parent's sentinel while it waits for a command and
exits. A watchdog thread in rank 0 logs a worker's death and report the moment it exits; over NCCL, where rank 0
may be blocked for good in a collective (or a synchronisation) waiting for the dead rank, it ends rank 0's process
if rank 0 has not raised the failure itself within `BLOCKED_EXIT_SECONDS`.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import socket
import sys
import threading
import time
import traceback
from itertools import count
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from cpu_experts.topology import RankCpus, discover_nodes, pin_current_thread, pinned_thread, rank_cpus, thread_cpus
from hybrid import parallel
from hybrid.rank_stats import RankTable
from hybrid.step_channel import StepChannel

log = logging.getLogger(__name__)

JOINING = "joining"  # a worker's first report: it has started and joins the ranks now
JOIN_SECONDS = 30.0  # a worker that has not exited this long after "stop" is terminated
REPORT_SECONDS = 5.0  # how long rank 0 waits for a failed worker's report
# Over NCCL, how long rank 0 may stay blocked after a worker died before its process exits: a collective that waits
# for a dead rank waits for NCCL's timeout (minutes), and aborting the communicator under captured graphs hangs
BLOCKED_EXIT_SECONDS = 20.0
WATCH_SECONDS = 0.5  # how often the watchdog looks at the workers' processes


_is_worker = False  # this process is a rank that rank 0 started (`worker_main`)


def is_worker() -> bool:
    return _is_worker


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: cuda:r where the engine's device is CUDA, else the device as given."""
    return f"cuda:{rank}" if torch.device(device).type == "cuda" else device


def find_rank_cpus(config, rank: int) -> RankCpus:
    """Rank `rank`'s CPUs (module docstring), found from the process's CPUs before any of its threads is pinned."""
    is_cuda = torch.device(config.device).type == "cuda"
    return rank_cpus(discover_nodes(), rank, config.tensor_parallel_size, leave_host_cpu=is_cuda)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Workers:
    """Rank 0's side: the other ranks' processes, the channel of commands and the failures they report."""

    def __init__(self, path, config):
        self.size = config.tensor_parallel_size
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        if torch.device(config.device).type == "cuda":
            parallel.set_nccl_environment()  # inherited by the spawned ranks
        context = mp.get_context("spawn")
        pipes = [context.Pipe(duplex=False) for _ in range(1, self.size)]  # (rank 0's end, the worker's)
        self.reports = [reader for reader, _ in pipes]
        table = RankTable(self.size, is_shared=True)  # every rank's metrics (`hybrid.rank_stats`)
        self.channel = StepChannel(self.size - 1)  # every command, in order (`hybrid.step_channel`)
        self.processes = [context.Process(target=worker_main,
                                          args=(str(path), config, rank, init_method, writer, table, self.channel),
                                          name=f"hybrid-tp-rank{rank}", daemon=True)
                          for rank, (_, writer) in enumerate(pipes, start=1)]
        for process in self.processes:
            process.start()
        for _, writer in pipes:
            writer.close()  # the workers' now
        self._runner_ids = count(1)
        self.is_stopped = False
        self._is_stopping = False
        self._failures: list[str] = []  # workers' reports, read by whichever thread saw them first
        self._lock = threading.Lock()
        self._is_raised = threading.Event()  # rank 0 raised a worker's failure (the watchdog need not end it)
        self.is_cuda = torch.device(config.device).type == "cuda"  # NCCL; stepping threads pinned
        self._pinned: dict[int, tuple[int, ...] | None] = {}  # a stepping thread -> its CPUs before (`send`)
        try:
            self.cpus = find_rank_cpus(config, 0)
            self._wait_joining()
            with pinned_thread(self.cpus.host if self.is_cuda else None):  # gloo's and NCCL's threads there
                parallel.init(0, self.size, init_method, rank_device(config.device, 0), table, self.cpus)
        except BaseException:
            self._terminate()
            raise
        threading.Thread(target=self._watch, name="hybrid-tp-watchdog", daemon=True).start()

    def _wait_joining(self) -> None:
        """Until every worker has started and is about to join the ranks: one that fails before (an import) is
        raised here, where rank 0 joining first would wait for it until the groups' timeout."""
        pending = dict(enumerate(self.reports, start=1))
        while pending:
            wait([*pending.values(), *(p.sentinel for p in self.processes)])
            for rank, reader in list(pending.items()):
                try:
                    message = reader.recv() if reader.poll() else None
                except EOFError:
                    message = f"rank {rank} exited with code {self.processes[rank - 1].exitcode} before joining"
                if message == JOINING:
                    del pending[rank]
                elif message is not None:
                    raise RuntimeError(f"tensor-parallel {message}")

    def alive(self) -> tuple[bool, ...]:
        """Whether each worker's process lives, ranks 1..N-1; safe from any thread (its sentinel, no waitpid)."""
        return tuple(not wait([p.sentinel], timeout=0) for p in self.processes)

    def wait_ready(self) -> None:
        """After rank 0 built its shard: every worker built its own (or the one that failed is raised)."""
        self.guard(lambda: dist.barrier(group=parallel.host_group()))

    def new_runner(self, max_graph_batch: int) -> int:
        """Announces a graph-capturing runner: the workers build theirs (and capture with rank 0)."""
        runner_id = next(self._runner_ids)
        self.send(("runner", runner_id, max_graph_batch))
        return runner_id

    def send(self, command: tuple) -> None:
        """Writes `command` for every worker and returns (it waits only where the channel is full). The thread that
        sends is the one that steps rank 0: pinned to rank 0's host CPU (module docstring) until `stop`."""
        if self.is_cuda and threading.get_ident() not in self._pinned:
            self._pinned[threading.get_ident()] = thread_cpus()
            pin_current_thread(self.cpus.host)
        self.check()
        self.channel.write(command, self.check)

    def check(self) -> None:
        """Raises the error of a worker that has exited (cheap: one waitpid per worker)."""
        for rank, process in enumerate(self.processes, start=1):
            if not process.is_alive() and not self.is_stopped:
                self.raise_reported()
                self._is_raised.set()
                raise RuntimeError(f"tensor-parallel rank {rank} exited with code {process.exitcode}")

    def raise_reported(self) -> None:
        """After a collective failed: raises a worker's own report of its failure, where one comes (a failed worker
        reports, then exits: this waits for the first exit, a few seconds at most); else returns."""
        wait([p.sentinel for p in self.processes], timeout=REPORT_SECONDS)
        self._read_reports()
        if self._failures:
            self._is_raised.set()
            raise RuntimeError(f"tensor-parallel {self._failures[0]}")

    def _read_reports(self) -> None:
        with self._lock:
            for reader in self.reports:
                try:
                    report = reader.recv() if reader.poll() else None
                except (EOFError, OSError):  # exited without a report (killed), or already closed
                    continue
                if report is not None:
                    self._failures.append(report)

    def _watch(self) -> None:
        """Rank 0's watchdog: a worker that exits while the ranks run is logged with its report at once; over NCCL
        rank 0's process ends unless rank 0 raises the failure itself within `BLOCKED_EXIT_SECONDS`."""
        sentinels = [p.sentinel for p in self.processes]
        while not wait(sentinels, timeout=WATCH_SECONDS):
            if self._is_stopping:
                return
        if self._is_stopping:
            return
        self._read_reports()  # a failed worker reports before it exits
        # by sentinel, not is_alive(): the sentinel closes as the process exits, a moment before waitpid sees it
        gone = [rank for rank, is_alive in enumerate(self.alive(), start=1) if not is_alive]
        what = self._failures[0] if self._failures else f"rank {gone[0]} exited without a report (killed?)"
        log.error("tensor-parallel rank(s) %s exited while the ranks run: %s", gone, what)
        if self.is_cuda and not self._is_raised.wait(BLOCKED_EXIT_SECONDS) and not self._is_stopping:
            log.critical("rank 0 is still blocked %.0f s after a rank died (a collective waits for it): exiting",
                         BLOCKED_EXIT_SECONDS)
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    def guard(self, work):
        """work() -> its result; where a collective in it fails, the failed worker's report is raised instead."""
        try:
            return work()
        except RuntimeError as exc:
            self._is_raised.set()
            try:
                self.raise_reported()
            except RuntimeError as reported:
                raise reported from exc
            raise

    def stop(self) -> None:
        """Tells the workers to exit and joins them (terminating any that hang); leaves the process groups."""
        if self.is_stopped:
            return
        self._is_stopping = True  # the workers' exits from here on are expected (`_watch`)
        is_told = False
        deadline = time.monotonic() + JOIN_SECONDS

        def check() -> None:  # a full channel: a worker that reads no more is not waited for long
            self.check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"a tensor-parallel worker read no command for {JOIN_SECONDS:.0f} s")

        try:
            if all(p.is_alive() for p in self.processes):  # else the others wait for a step that never comes
                self.channel.write(("stop",), check)
                is_told = True
        except RuntimeError as exc:
            log.warning("stopping the tensor-parallel workers: %s", exc)
        self.is_stopped = True
        previous = self._pinned.pop(threading.get_ident(), None)
        if previous is not None:  # the stepping thread (say the main thread) may start other ranks after
            pin_current_thread(previous)
        if is_told:  # the workers leave the groups now: rank 0 with them (`parallel.destroy`)
            parallel.destroy()
            for process in self.processes:
                process.join(timeout=JOIN_SECONDS)
        is_hung = any(p.is_alive() for p in self.processes)
        self._terminate()
        if not is_told or is_hung:
            parallel.destroy(is_abort=True)

    def _terminate(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join()


def worker_main(path: str, config, rank: int, init_method: str, report, table: RankTable,
                channel: StepChannel) -> None:
    """Rank `rank`'s process: joins the ranks, builds its shard of the model, serves rank 0's commands from
    `channel`; a failure goes to rank 0 through `report` (a pipe's sending end); its metrics go into its row of
    `table`."""
    global _is_worker
    _is_worker = True
    # tqdm's default lock is a multiprocessing semaphore, which the fast exit below would leak: a thread lock does
    tqdm.set_lock(threading.RLock())
    code = 0
    try:
        from hybrid.llm import LLM

        report.send(JOINING)
        cpus = find_rank_cpus(config, rank)
        is_cuda = torch.device(config.device).type == "cuda"
        with pinned_thread(cpus.host if is_cuda else None):  # gloo's and NCCL's threads start here: they inherit it
            parallel.init(rank, config.tensor_parallel_size, init_method, rank_device(config.device, rank), table,
                          cpus)
        llm = LLM(path, config)
        dist.barrier(group=parallel.host_group())  # this rank is ready (`Workers.wait_ready`)
        serve(llm, channel, rank)
        llm.close()
        parallel.destroy()
    except BaseException as exc:  # rank 0 raises it (`Workers.raise_reported`); its sockets close as this process exits
        lines = traceback.format_exception(exc)
        with contextlib.suppress(OSError):  # rank 0 is gone (`ChannelClosed`): nobody to tell
            report.send(f"rank {rank} failed: {type(exc).__name__}: {exc}\n{''.join(lines)}")
        code = 1
    # nothing is left to tear down that the interpreter's exit would (seconds of module teardown per worker)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def parent_alive():
    """Whether the process that spawned this one lives (its sentinel: the pipe it spawned us through closes as it
    exits); a process not spawned by multiprocessing: whether its parent is still the one it started with."""
    parent = multiprocessing.parent_process()
    if parent is None:
        ppid = os.getppid()
        return lambda: os.getppid() == ppid
    return lambda: not wait([parent.sentinel], timeout=0)


@torch.inference_mode()
def serve(llm, channel: StepChannel, rank: int) -> None:
    """Runs rank 0's commands until "stop"; `ChannelClosed` where rank 0 exits meanwhile."""
    from hybrid.model_runner import ModelRunner

    runners: dict[int, ModelRunner] = {}
    is_cuda = llm.engine_config.is_cuda
    is_rank0_alive = parent_alive()
    if is_cuda:  # this thread steps the rank from now on (it loaded the shard on every CPU of the process)
        pin_current_thread(parallel.rank_cpus().host)
    while True:
        command = channel.read(rank - 1, is_rank0_alive)
        kind = command[0]
        if kind == "stop":
            break
        if kind == "execute":
            _, runner_id, seqs, input_ids, logit_rows = command
            runner = llm.runner if runner_id is None else runners[runner_id]
            runner.execute(seqs, input_ids, logit_rows)  # the logits are rank 0's
            if is_cuda:
                torch.cuda.synchronize()  # what rank 0's reading of the logits does before its finish_step
            runner.finish_step()
        elif kind == "runner":
            _, runner_id, max_graph_batch = command
            runners[runner_id] = ModelRunner(llm, max_graph_batch)
        elif kind == "close":
            runners.pop(command[1]).close()
        else:
            raise RuntimeError(f"unknown tensor-parallel command {kind!r}")
    for runner in runners.values():
        runner.close()
