"""The engine loop over one model: requests in, tokens out, continuous batching. Each `step` is
schedule -> run -> update:

1. schedule (`hybrid.scheduler`): which requests run and how many of their tokens (decodes and prefill chunks mixed
   under one token budget, prefix-cached pages reused, newest preempted when pages run out);
2. run (`hybrid.model_runner.ModelRunner`): the step's inputs prepared from all scheduled chunks, one forward
   pass, logits only for the chunks that end at a request's last token; on CUDA a step of single-token chunks
   replays a captured graph (`hybrid.cuda_graphs`, owned by the runner);
3. update: sample every row at once on the device (`hybrid.sampling.sample_batch`: each request's parameters,
   penalties and seed; one transfer to the host), append, finish on a stop token, a stop string (with a tokenizer,
   `hybrid.detokenizer`) or max_tokens, free the pages of finished requests, publish full pages to the prefix cache.
   Grammar-constrained requests (`hybrid.guided`) have their token masks filled on the host first, while the
   forward pass still runs on the device; a request whose grammar ends finishes with "stop".

`Engine` takes an `LLM` (the model, its KV cache and its config) and takes its pages from the LLM's one set of
per-cache-group allocators (`llm.blocks`), so pages are never handed out twice; the newest engine built over an
LLM is the one `LLM.generate` runs through. The CPU path runs this same loop.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from hybrid.detokenizer import IncrementalDetokenizer
from hybrid.guided import GrammarCache, GuidedRequests
from hybrid.model_runner import ModelRunner
from hybrid.sampling import RowInputs, SampleResult, SamplingParams, sample_batch
from hybrid.scheduler import Request, ScheduledChunk, Scheduler


@dataclass(frozen=True)
class StepOutput:
    request_id: int
    new_token: int
    finish_reason: str | None  # "stop", "length", "error" (see `error`), or None while the request goes on
    logprob: float | None = None  # the new token's, when the request's params.logprobs asked (see sample_batch)
    top_logprobs: tuple[tuple[int, float], ...] | None = None  # (token id, logprob), most likely first
    text: str | None = None  # with a tokenizer: the new text (held back while it could start a stop string)
    error: str | None = None  # why the request failed (finish_reason "error"; new_token is then -1)


@dataclass
class HostSeconds:
    """Where the steps' host time goes, summed over the engine's steps (`Engine.host_seconds`): what a benchmark
    reads from outside to tell a constrained step's cost apart (masks, the matchers' accepts) from the rest."""

    schedule: float = 0.0  # the scheduler and the state copies it queued
    run: float = 0.0  # inputs prepared and the forward pass launched (graph replay) or run (eager); hot experts'
    # copies started meanwhile
    masks: float = 0.0  # grammar masks filled, while the device computes the logits
    sample: float = 0.0  # the batched draw, its wait for the logits included
    update: float = 0.0  # tokens appended, matchers advanced, detokenized, finished; the step's CPU side checked


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics: requests by state, KV-cache pages (over all cache groups), recurrent-state slots and
    the prefix cache's state snapshots (0 for a model without recurrent layers), and prefix-cache hits so far
    (tokens taken from the cache at admission; admissions whose recurrent states a snapshot restored)."""

    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    num_state_slots: int = 0
    num_free_state_slots: int = 0
    num_state_snapshots: int = 0
    num_kept_state_snapshots: int = 0
    num_cached_tokens: int = 0
    num_snapshot_hits: int = 0


class Engine:
    def __init__(self, llm, max_num_batched_tokens: int | None = None, max_num_seqs: int | None = None,
                 tokenizer=None, allow_cuda_graphs: bool = True):
        """`max_num_batched_tokens`: tokens per step (None: the engine config's, default 512 or max_model_len if
        smaller); at most max_model_len, the largest step the CPU experts' staging buffers take. Steps in which no
        request decodes may take the LLM's layer-wise budget (`LLM.max_step_tokens`) where experts stream.
        `max_num_seqs` (None: the engine config's): requests run together; the config's values size the
        sliding-window cache groups, and larger ones here still run, queued where those pools run short.
        `tokenizer` (a transformers tokenizer): outputs carry their text, and requests may stop on strings.
        `allow_cuda_graphs` False: decode eagerly even where the config's `cuda_graph` would capture (`LLM.generate`'s
        own engine: one request, eager numerics)."""
        max_num_batched_tokens = max_num_batched_tokens or llm.max_num_batched_tokens
        # layer-wise prefill (`LLM.max_step_tokens`): the budget of the steps in which no request decodes
        max_prefill_tokens = llm.max_step_tokens if llm.max_step_tokens > llm.max_num_batched_tokens else 0
        max_num_seqs = max_num_seqs or llm.engine_config.max_num_seqs
        if max_num_batched_tokens > llm.max_model_len:
            raise ValueError(f"max_num_batched_tokens {max_num_batched_tokens} exceeds max_model_len "
                             f"{llm.max_model_len}; lower it or build the LLM with a larger max_model_len")
        self.llm = llm
        self.device = llm.engine_config.device
        self.block_size = llm.engine_config.block_size
        self.blocks = llm.blocks  # the model's one owner of KV pages (LLM.prefill_logits allocates from it too)
        if llm.hot_experts is not None:
            llm.hot_experts.drain()  # no copy thread issues CUDA calls while the runner captures graphs
        self.runner = ModelRunner.for_engine(llm, max_num_seqs, allow_cuda_graphs)
        self.scheduler = Scheduler(self.blocks, max_num_batched_tokens, max_num_seqs, max_prefill_tokens)
        self.requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self._generators: dict[int, torch.Generator] = {}
        self.tokenizer = tokenizer
        self._detokenizers: dict[int, IncrementalDetokenizer] = {}
        # compiled grammars: the server attaches its tokenizer and compiles there, where the engine has none
        self.grammars = GrammarCache(llm.config.vocab_size, tokenizer)
        self._guided = GuidedRequests(self.grammars, pin_memory=torch.device(self.device).type == "cuda")
        self.host_seconds = HostSeconds()
        llm.attach_engine(self)

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None, max_tokens: int = 16,
                    stop_token_ids: list[int] | None = None, ignore_eos: bool = False, stop: tuple[str, ...] = (),
                    skip_special_tokens: bool = True) -> int:
        """`stop`: strings that end the request (needs the engine's tokenizer); the token that completes one is the
        last output id, and the text stops before the string."""
        params = params or SamplingParams()
        self.llm._check_prompt(prompt_ids, max_tokens)
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        outside = [t for t, _ in params.logit_bias if t >= self.llm.config.vocab_size]
        if outside:
            raise ValueError(f"logit_bias token id {outside[0]} is outside the vocabulary [0, "
                             f"{self.llm.config.vocab_size})")
        if stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: build the engine with Engine(llm, tokenizer=...)")
        if params.guided is not None:
            self.grammars.get(params.guided)  # an invalid spec fails here, before the request exists
        stops = set(stop_token_ids or ()) | (set() if ignore_eos else set(self.llm.config.eos_token_ids))
        request = Request(next(self._ids), list(prompt_ids), params, max_tokens, frozenset(stops))
        self.scheduler.add(request)
        if params.guided is not None:
            self._guided.add(request.request_id, params.guided, request.stop_token_ids)
        self.requests[request.request_id] = request
        if params.seed is not None:
            self._generators[request.request_id] = torch.Generator(device=self.device).manual_seed(params.seed)
        if self.tokenizer is not None:
            self._detokenizers[request.request_id] = IncrementalDetokenizer(self.tokenizer, list(prompt_ids),
                                                                            tuple(stop), skip_special_tokens)
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
            self._detokenizers.pop(request_id, None)
            self._guided.remove(request_id)

    def stats(self) -> EngineStats:
        slots, snapshots, scheduler = self.blocks.state_slots, self.blocks.snapshots, self.scheduler
        return EngineStats(len(scheduler.running), len(scheduler.waiting), self.blocks.num_blocks,
                           self.blocks.num_free, slots.num_slots if slots else 0, slots.num_free if slots else 0,
                           snapshots.num_snapshots if snapshots else 0, snapshots.num_cached if snapshots else 0,
                           scheduler.num_cached_tokens, scheduler.num_snapshot_hits)

    def close(self) -> None:
        if self.runner is not self.llm.runner:
            self.runner.close()
        self.llm.detach_engine(self)  # LLM.generate no longer runs through a closed engine

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def idle(self) -> None:
        """What the engine does while it has nothing to run: the hot experts flip the swaps whose copies landed,
        decide if steps ran since their last decision and start every decided copy (`HotExperts.at_idle`). A
        server's loop calls it once each time its work runs out, before it waits for requests; bounded work, no
        wait for the device."""
        if self.llm.hot_experts is not None:
            self.llm.hot_experts.at_idle()

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        clock, start = self.host_seconds, time.perf_counter()
        chunks = self.scheduler.schedule()
        self.runner.copy_states(self.scheduler.take_state_copies())  # state snapshots restored on admission
        if not chunks:
            self.idle()  # experts move while no step runs
            return []
        hot = self.llm.hot_experts
        launched = time.perf_counter()
        clock.schedule += launched - start
        logits = self.runner.execute_chunks(chunks)
        if hot is not None:
            hot.during_step()  # while the device runs the step: expert copies start (`hybrid.hot_experts`)
        clock.run += time.perf_counter() - launched
        outputs = self._update(chunks, logits)
        updated = time.perf_counter()
        self.runner.copy_states(self.scheduler.take_state_copies())  # snapshots of the states this step ended at
        self.runner.finish_step()  # the update read the logits: the step's GPU work is over
        if hot is not None:
            hot.after_step()  # between steps: swaps flip, copies start (`hybrid.hot_experts`)
        clock.update += time.perf_counter() - updated
        return outputs

    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None, max_tokens: int = 16,
                 ignore_eos: bool = False, stop: tuple[str, ...] = ()) -> list[list[int]]:
        """Runs the prompts together to completion; each one's new token ids, in the prompts' order."""
        ids = [self.add_request(p, params, max_tokens, ignore_eos=ignore_eos, stop=stop) for p in prompts]
        while self.has_work():
            self.step()
        return [self.requests.pop(i).output_ids for i in ids]

    def _update(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> list[StepOutput]:
        sampled = [chunk.request for chunk in chunks if chunk.is_last]  # logits' rows, in order; before num_computed
        for chunk in chunks:
            self.scheduler.advance(chunk.request, chunk.num_new)
        if not sampled:
            return []
        result = self._sample(sampled, logits)
        start = time.perf_counter()
        outputs = self._append(sampled, result)
        self.host_seconds.update += time.perf_counter() - start
        return outputs

    def _append(self, sampled: list[Request], result: SampleResult) -> list[StepOutput]:
        """Each sampled request's new token: accepted by its grammar, appended, finished where it ends."""
        outputs = []
        for i, r in enumerate(sampled):
            if result.errors[i] is not None:
                self.finish(r.request_id, "error")
                outputs.append(StepOutput(r.request_id, -1, "error", error=result.errors[i]))
                continue
            token = result.token_ids[i]
            is_accepted, has_ended = self._guided.accept(r.request_id, token)
            if not is_accepted:  # the mask allowed it: the grammar and the mask disagree
                self.finish(r.request_id, "error")
                outputs.append(StepOutput(r.request_id, -1, "error", error=f"token {token} breaks the grammar"))
                continue
            r.output_ids.append(token)
            reason = "stop" if token in r.stop_token_ids or has_ended else \
                "length" if len(r.output_ids) >= r.max_tokens else None
            text, detokenizer = None, self._detokenizers.get(r.request_id)
            if detokenizer is not None:
                text, reason = detokenizer.step(token, reason)  # a stop string also ends it: "stop"
            if reason:
                self.finish(r.request_id, reason)
            outputs.append(StepOutput(r.request_id, token, reason, result.logprobs[i], result.top_logprobs[i], text))
        return outputs

    def _sample(self, requests: list[Request], logits: torch.Tensor) -> SampleResult:
        """logits [len(requests), V] -> every request's next token in one batched draw (one host sync); a seeded
        request draws from its own generator, the rest from the device's default one. The constrained requests'
        masks are filled here, before anything waits for the logits."""
        start = time.perf_counter()
        mask = self._guided.fill([r.request_id for r in requests])
        filled = time.perf_counter()
        rows = [RowInputs(r.params, self._generators.get(r.request_id), r.prompt_ids, r.output_ids) for r in requests]
        result = sample_batch(logits, rows, mask=mask)
        self.host_seconds.masks += filled - start
        self.host_seconds.sample += time.perf_counter() - filled
        return result
