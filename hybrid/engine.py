"""The engine loop over one model: requests in, tokens out, continuous batching. Each `step` is
schedule -> run -> update:

1. schedule (`hybrid.scheduler`): which requests run and how many of their tokens (decodes and prefill chunks mixed
   under one token budget, prefix-cached pages reused, newest preempted when pages run out);
2. run: one `ForwardBatch` over all scheduled chunks, one forward pass, logits only for the chunks that end at a
   request's last token;
3. update: sample (per request's parameters and penalties), append, finish on a stop token or max_tokens, free the
   pages of finished requests, publish full pages to the prefix cache.

`Engine` takes an `LLM` (the model, its KV cache and its config); the block manager replaces the LLM's simple
allocator for the pages the engine hands out. The CPU path runs this same loop.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from hybrid.block_manager import PrefixCachingBlockManager
from hybrid.forward_batch import ForwardBatch, SequenceSlice
from hybrid.sampling import SamplingParams, apply_penalties, sample
from hybrid.scheduler import Request, ScheduledChunk, Scheduler


@dataclass(frozen=True)
class StepOutput:
    request_id: int
    new_token: int
    finish_reason: str | None  # "stop", "length", or None while the request goes on


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics: requests by state and KV-cache pages."""

    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int


class Engine:
    def __init__(self, llm, max_num_batched_tokens: int | None = None, max_num_seqs: int = 64,
                 enable_prefix_caching: bool = True):
        """`max_num_batched_tokens`: tokens per step (None: 512, or max_model_len if smaller); at most max_model_len,
        the largest step the CPU experts' staging buffers take."""
        max_num_batched_tokens = max_num_batched_tokens or min(512, llm.max_model_len)
        if max_num_batched_tokens > llm.max_model_len:
            raise ValueError(f"max_num_batched_tokens {max_num_batched_tokens} exceeds max_model_len "
                             f"{llm.max_model_len}; lower it or build the LLM with a larger max_model_len")
        self.llm = llm
        self.device = llm.engine_config.device
        self.block_size = llm.engine_config.block_size
        self.blocks = PrefixCachingBlockManager(llm.allocator.num_blocks, self.block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_num_batched_tokens, max_num_seqs)
        self.requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self._generators: dict[int, torch.Generator] = {}

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None, max_tokens: int = 16,
                    stop_token_ids: list[int] | None = None, ignore_eos: bool = False) -> int:
        params = params or SamplingParams()
        self.llm._check_prompt(prompt_ids, max_tokens)
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        stops = set(stop_token_ids or ()) | (set() if ignore_eos else set(self.llm.config.eos_token_ids))
        request = Request(next(self._ids), list(prompt_ids), params, max_tokens, frozenset(stops))
        self.scheduler.add(request)
        self.requests[request.request_id] = request
        if params.seed is not None:
            self._generators[request.request_id] = torch.Generator(device=self.device).manual_seed(params.seed)
        return request.request_id

    def cancel(self, request_id: int) -> None:
        self.finish(request_id, "cancelled")

    def finish(self, request_id: int, reason: str = "stop") -> None:
        """Ends a request now (a stop string the caller found, a client gone) and frees its pages; a finished or
        unknown request is left alone."""
        request = self.requests.get(request_id)
        if request is not None and not request.is_finished:
            self.scheduler.finish(request, reason)
            self._generators.pop(request_id, None)

    def stats(self) -> EngineStats:
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), self.blocks.num_blocks,
                           self.blocks.num_free)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        logits = self._run(chunks)
        return self._update(chunks, logits)

    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None, max_tokens: int = 16,
                 ignore_eos: bool = False) -> list[list[int]]:
        """Runs the prompts together to completion; each one's new token ids, in the prompts' order."""
        ids = [self.add_request(p, params, max_tokens, ignore_eos=ignore_eos) for p in prompts]
        while self.has_work():
            self.step()
        return [self.requests.pop(i).output_ids for i in ids]

    def _run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """One forward pass over every chunk -> float32 logits [chunks ending at their last token, V]."""
        seqs, input_ids, rows, row = [], [], [], -1
        for chunk in chunks:
            r = chunk.request
            seqs.append(SequenceSlice(r.num_computed, chunk.num_new, r.block_table))
            input_ids += r.token_ids[r.num_computed:r.num_computed + chunk.num_new]
            row += chunk.num_new
            if chunk.is_last:
                rows.append(row)
        batch = ForwardBatch.build(seqs, self.block_size, self.device)
        hidden = self.llm.model(torch.tensor(input_ids, dtype=torch.int64, device=self.device), batch)
        self.llm.num_forward_tokens += len(input_ids)
        if not rows:
            return hidden.new_empty(0)
        return self.llm.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])

    def _update(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> list[StepOutput]:
        outputs, row = [], 0
        for chunk in chunks:
            r = chunk.request
            is_last = chunk.is_last
            r.num_computed += chunk.num_new
            self.blocks.cache_full_blocks(r.block_table, r.token_ids[:r.num_computed])
            if not is_last:
                continue
            token = self._sample(r, logits[row])
            row += 1
            r.output_ids.append(token)
            reason = "stop" if token in r.stop_token_ids else "length" if len(r.output_ids) >= r.max_tokens else None
            if reason:
                self.scheduler.finish(r, reason)
                self._generators.pop(r.request_id, None)
            outputs.append(StepOutput(r.request_id, token, reason))
        return outputs

    def _sample(self, request: Request, logits: torch.Tensor) -> int:
        params = request.params
        if params.has_penalties:
            logits = apply_penalties(logits, request.prompt_ids, request.output_ids, params)
        return int(sample(logits[None], params, self._generators.get(request.request_id))[0])
