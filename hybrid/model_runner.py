"""The model runner: the one place a step's inputs are prepared and the model is run.

Given the step's sequences (`SequenceSlice`: tokens already cached, tokens run now, one block table per cache
group) it prepares positions, slot mappings and block tables (`StepInputs.prepare`), runs the forward pass eagerly
or, for a decode step on CUDA, replays a captured graph whose static buffers are filled from the same prepared
inputs (`hybrid.cuda_graphs`), and returns float32 logits of the rows asked for. The engine's steps
(`Engine.step`), `LLM.prefill_logits` and, through the engine, `LLM.generate` all run here.

Each LLM has an eager runner (`LLM.runner`); an engine that may replay graphs builds a runner of its own that
owns the captured graphs (sized by its `max_num_seqs`), closed with the engine.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybrid.forward_batch import ForwardBatch, SequenceSlice, StepInputs


class ModelRunner:
    def __init__(self, llm, max_graph_batch: int = 0):
        """`max_graph_batch` > 0: capture decode graphs up to that batch (call only where `can_capture`)."""
        self.llm = llm
        self.model = llm.model
        self.device = llm.engine_config.device
        self.block_size = llm.engine_config.block_size
        self.graphs = None
        # tensor parallel, rank 0: every step goes to the other ranks from here (`hybrid.tp_workers`); a graph
        # runner is announced before it captures, so that every rank captures the same graphs with it
        self.workers = getattr(llm, "workers", None)
        self.runner_id = None  # the eager runner: each rank's own `LLM.runner`
        if max_graph_batch and self.workers is not None:
            self.runner_id = self.workers.new_runner(max_graph_batch)
        if max_graph_batch:
            from hybrid.cuda_graphs import CudaGraphRunner

            self.graphs = CudaGraphRunner(llm, max_graph_batch)
            self.graphs.capture()

    @staticmethod
    def can_capture(llm) -> bool:
        """Decode as CUDA graphs where they can run: CUDA, the Triton attention kernels (the PyTorch attention
        loops over host lengths, which a graph would freeze), recurrent layers only on their kernels (the PyTorch
        Gated DeltaNet loops over host lengths too), device experts only on the fused kernel, and `cuda_graph` left
        on; otherwise every step runs eagerly."""
        cfg = llm.engine_config
        attention = llm.backends.attention
        # experts on the engine's device through the PyTorch reference (float32) pick their experts on the host
        experts_ok = all(m.is_graph_safe for m in llm.model.modules() if hasattr(m, "is_graph_safe"))
        return (cfg.cuda_graph and cfg.is_cuda and attention.name == "triton" and experts_ok
                and (not llm.config.has_recurrent_layers or attention.has_linear_kernels))

    @classmethod
    def for_engine(cls, llm, max_num_seqs: int, allow_cuda_graphs: bool) -> ModelRunner:
        """The runner an engine steps through: one that captures graphs where they can run, else the LLM's own."""
        if allow_cuda_graphs and cls.can_capture(llm):
            return cls(llm, min(llm.engine_config.max_graph_batch, max_num_seqs))
        return llm.runner

    def prepare(self, seqs: Sequence[SequenceSlice]) -> StepInputs:
        return StepInputs.prepare(seqs, self.block_size)

    def execute_chunks(self, chunks) -> torch.Tensor:
        """The engine's step (`hybrid.scheduler.ScheduledChunk`s) -> float32 logits [chunks that end at their
        request's last token, V], in the chunks' order."""
        seqs, input_ids, rows, row = [], [], [], -1
        for chunk in chunks:
            r = chunk.request
            seqs.append(SequenceSlice(r.num_computed, chunk.num_new, r.block_tables, r.state_slot))
            input_ids += r.token_ids[r.num_computed:r.num_computed + chunk.num_new]
            row += chunk.num_new
            if chunk.is_last:
                rows.append(row)
        return self.execute(seqs, input_ids, rows)

    def execute(self, seqs: Sequence[SequenceSlice], input_ids: list[int],
                logit_rows: list[int] | None = None) -> torch.Tensor:
        """One forward pass over the sequences' new tokens (`input_ids`, concatenated) -> float32 logits
        [len(logit_rows), V] (every row where `logit_rows` is None). A decode step that samples every sequence
        replays a graph where one is captured for its batch. Tensor parallel: the same step on every rank, sent
        from rank 0 here (the ranks decide graph or eager alike, from the same inputs)."""
        if self.workers is None:
            return self._execute(seqs, input_ids, logit_rows)
        self.workers.send(("execute", self.runner_id, list(seqs), list(input_ids), logit_rows))
        return self.workers.guard(lambda: self._execute(seqs, input_ids, logit_rows))

    def _execute(self, seqs: Sequence[SequenceSlice], input_ids: list[int],
                 logit_rows: list[int] | None) -> torch.Tensor:
        self.llm.num_forward_tokens += len(input_ids)
        self.llm.counters.num_steps += 1
        graphs = self.graphs
        inputs = self.prepare(seqs)
        # a graph step decodes every row from its cached context (and its recurrent state: the graph cannot zero
        # the slot of a sequence that starts at this step, a one-token prompt)
        is_decode = (all(s.num_new == 1 for s in seqs) and (logit_rows is None or len(logit_rows) == len(seqs))
                     and all(resumes or slot < 0 for slot, resumes in zip(inputs.state_slots,
                                                                          inputs.has_initial_state, strict=True)))
        if graphs is not None and is_decode and graphs.can_run(len(seqs)):
            return graphs.run(inputs, input_ids)
        if graphs is not None:
            graphs.before_eager(len(input_ids))
        batch = ForwardBatch.from_inputs(inputs, self.block_size, self.device)
        hidden = self.model(torch.tensor(input_ids, dtype=torch.int64, device=self.device), batch)
        if logit_rows is None:
            return self.model.compute_logits(hidden)
        if not logit_rows:
            return hidden.new_empty(0)
        return self.model.compute_logits(hidden[torch.tensor(logit_rows, device=hidden.device)])

    def copy_states(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copies rows of every recurrent layer's state pools (recurrent and conv), `(from row, to row)` pairs with
        the effect of copying them in order: prefix caching's state snapshots taken and restored
        (`hybrid.scheduler`). Eager copies between steps, never inside a captured graph; on the device's stream,
        so they land after the step that wrote the states and before the next one reads them."""
        batches: list[list[tuple[int, int]]] = [[]]
        targets: set[int] = set()
        for source, target in copies:
            if source in targets or target in targets:  # depends on an earlier copy of the list: after it
                batches.append([])
                targets.clear()
            batches[-1].append((source, target))
            targets.add(target)
        for batch in filter(None, batches):
            source_rows, target_rows = (torch.tensor(rows, device=self.device) for rows in zip(*batch, strict=True))
            for pools in self.llm.state_caches:
                for pool in pools:
                    pool.index_copy_(0, target_rows, pool.index_select(0, source_rows))

    def finish_step(self) -> None:
        """After the host has read the step's logits: a graph step's CPU side is checked; the rank's numbers are
        published (`hybrid.rank_stats`)."""
        try:
            if self.graphs is not None:
                self.graphs.finish_step()
        finally:
            counters = self.llm.counters
            counters.add_cpu_seconds(self._cpu_sources())
            counters.publish()

    def _cpu_sources(self) -> list:
        """What computes this runner's CPU experts, each with a cumulative `compute_seconds`: the model's executor
        (eager steps, shared with the model's other runners), the graphs' flag worker and decode pool."""
        sources = [self.llm.cpu_executor] if self.llm.cpu_executor is not None else []
        return sources + self._graph_sources()

    def _graph_sources(self) -> list:
        """The graphs' own CPU-experts sources (flag worker, decode pool); none without graphs."""
        if self.graphs is None:
            return []
        return [s for s in (self.graphs.worker, self.graphs.pool) if s is not None]

    def close(self) -> None:
        if self.graphs is not None:
            self.llm.counters.forget(self._graph_sources())
            self.graphs.close()
        if self.runner_id is not None and not self.workers.is_stopped:
            self.workers.send(("close", self.runner_id))
