"""The token-budget scheduler: which requests run in the next step, and how many of their tokens.

Each step has a budget of `max_num_batched_tokens` and `max_num_seqs`. Running requests come first, oldest first:
a decoding request takes one token, a request still in its prompt takes a chunk of it (chunked prefill), so long
prompts never stall the decodes beside them. A step in which no request decodes may take up to
`max_prefill_tokens` instead (layer-wise prefill, where streamed experts are reused by every token of a step:
`hybrid.llm.LLM.max_step_tokens`). Waiting requests are admitted after that while budget and KV pages
last; a request's cached prefix (`CacheGroupBlocks.match_prefix`) is not recomputed. A request keys each
of its full pages once, when the page fills (`advance`), and publishes it to the prefix cache then. A request holds
one block table per cache group; at each step start, sliding-window groups take back the pages before its window.
When a running request needs a page and none is free, the newest running request is preempted: its pages are freed
and it waits again at the head of the queue, to be recomputed (its tokens so far are kept); a windowed group short
of pages only shrinks a prefill chunk. A model with recurrent layers also gives each running request a state slot
(`CacheGroupBlocks.state_slots`), taken on admission and given back on finish, preemption or cancellation (a
preempted request recomputes its states from its first token, or from its prefix hit); with no slot free,
admission waits, as it does for pages. Such a model's prefix hits resume from state snapshots
(`CacheGroupBlocks.snapshots`), taken where a step ends on a page boundary (`_snapshot`; a prefill chunk ends at its
prompt's last page boundary for it, `_chunk`) and restored on admission: the scheduler queues the row copies
(`take_state_copies`) and the model runner makes them between steps. Nothing here touches torch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hybrid.block_manager import CacheGroupBlocks
from hybrid.sampling import SamplingParams


@dataclass
class Request:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)  # one per cache group
    num_computed: int = 0  # tokens whose KV is in the cache
    num_cached: int = 0  # of those, how many came from the prefix cache when it was admitted
    page_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full pages, each hashed once
    num_published: int = 0  # leading pages of the block tables published to the prefix cache
    finish_reason: str | None = None  # "stop", "length" or "cancelled"
    state_slot: int = -1  # its recurrent-state slot while it runs (models with recurrent layers), else -1
    snapshot_key: bytes | None = None  # the page key of its rolling state snapshot (`Scheduler._snapshot`)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    num_new: int  # tokens run this step, from request.num_computed on

    @property
    def is_last(self) -> bool:
        """The chunk reaches the request's last known token: its logits sample the next one."""
        return self.request.num_computed + self.num_new == self.request.num_tokens


class Scheduler:
    def __init__(self, blocks: CacheGroupBlocks, max_num_batched_tokens: int, max_num_seqs: int,
                 max_prefill_tokens: int = 0):
        """`max_prefill_tokens`: the budget of a step without decodes (0, or below max_num_batched_tokens: the
        same budget for every step)."""
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        self.blocks = blocks
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.max_prefill_tokens = max(max_prefill_tokens, max_num_batched_tokens)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # (from row, to row) copies of the recurrent-state pools the runner makes between steps: snapshot restores
        # queued at admission, snapshots queued as a step's chunks end (`take_state_copies`)
        self.state_copies: list[tuple[int, int]] = []
        self.num_cached_tokens = 0  # tokens admitted requests took from the prefix cache, over the run
        self.num_snapshot_hits = 0  # admissions that resumed their recurrent states from a snapshot

    def add(self, request: Request) -> None:
        problem = self.blocks.too_large(len(request.prompt_ids) + request.max_tokens)
        if problem is not None:
            raise ValueError(f"request {request.request_id} {problem}: shorten the prompt or max_tokens")
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        is_decoding = any(r.num_computed >= len(r.prompt_ids) for r in self.running)
        budget = self.max_num_batched_tokens if is_decoding else self.max_prefill_tokens
        chunks: list[ScheduledChunk] = []
        for request in self.running:
            self.blocks.release_out_of_window(request.block_tables, request.num_computed)
        for request in list(self.running):
            if budget == 0:
                break
            if request not in self.running:  # preempted by an older request in this loop
                continue
            num_new = self._reserve(request, self._chunk(request, budget), preempt=True)
            if not num_new:
                continue
            chunks.append(ScheduledChunk(request, num_new))
            budget -= num_new
        slots = self.blocks.state_slots
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            if slots is not None and slots.num_free == 0:
                break  # every state slot is held: the queue waits for a request to finish
            request = self.waiting[0]
            num_pages, request.block_tables = self._match_prefix(request)
            request.num_computed = num_pages * self.blocks.block_size
            request.num_cached, request.num_published = request.num_computed, num_pages
            num_new = self._reserve(request, self._chunk(request, budget), preempt=False)
            if not num_new:
                self._release(request)
                break  # first come, first served: nothing overtakes the head of the queue
            self.waiting.popleft()
            if slots is not None:
                request.state_slot = slots.allocate()
                if num_pages:  # resume the recurrent states from the snapshot after the hit's last page
                    row = self.blocks.snapshots.use(request.page_keys[num_pages - 1])
                    self.state_copies.append((row, request.state_slot))
                    self.num_snapshot_hits += 1
            self.num_cached_tokens += request.num_cached
            self.running.append(request)
            chunks.append(ScheduledChunk(request, num_new))
            budget -= num_new
        return chunks

    def _chunk(self, request: Request, budget: int) -> int:
        """The request's next chunk within the budget. With state snapshots, a chunk that would run past the last
        page boundary of the request's known tokens ends there instead: states exist only at step ends, and that
        boundary's snapshot is the one a resent prompt resumes from (the tail of less than a page runs next step)."""
        num_new = min(request.num_tokens - request.num_computed, budget)
        if self.blocks.snapshots is not None:
            boundary = request.num_tokens // self.blocks.block_size * self.blocks.block_size
            if request.num_computed < boundary < request.num_computed + num_new:
                num_new = boundary - request.num_computed
        return num_new

    def _match_prefix(self, request: Request) -> tuple[int, list[list[int]]]:
        """Cached pages of the request's leading full pages, up to its last token but one: the last token is
        always computed, since its logits pick the next one."""
        if not self.blocks.enable_prefix_caching:
            return 0, self.blocks.new_tables()
        num_pages = (request.num_tokens - 1) // self.blocks.block_size
        self.blocks.extend_keys(request.page_keys, request.token_ids, num_pages * self.blocks.block_size)
        return self.blocks.match_prefix(request.page_keys[:num_pages])

    def advance(self, request: Request, num_new: int) -> None:
        """The step computed `num_new` more of the request's tokens: pages that are now full are keyed (once) and
        published to the prefix cache."""
        request.num_computed += num_new
        num_full = request.num_computed // self.blocks.block_size
        if num_full <= request.num_published or not self.blocks.enable_prefix_caching:
            return
        self.blocks.extend_keys(request.page_keys, request.token_ids, request.num_computed)
        self.blocks.cache_pages(request.block_tables, request.num_published, num_full, request.page_keys)
        request.num_published = num_full
        if self.blocks.snapshots is not None and request.num_computed == num_full * self.blocks.block_size:
            self._snapshot(request, num_full)

    def _snapshot(self, request: Request, num_pages: int) -> None:
        """The step ended exactly after the request's first `num_pages` pages: its state slot holds the states of
        that position, copied to a snapshot keyed by that page (a hit there resumes from them). The snapshot at the
        last boundary of its prompt stays; the others roll, each replacing the request's previous one, so a request
        keeps at most two and, when it ends, the latest boundary it reached (a resent conversation's hit)."""
        is_prompt_end = num_pages == len(request.prompt_ids) // self.blocks.block_size
        key = request.page_keys[num_pages - 1]
        row = self.blocks.snapshots.take(key, None if is_prompt_end else request.snapshot_key)
        if row is None:
            return
        if not is_prompt_end:
            request.snapshot_key = key
        self.state_copies.append((request.state_slot, row))

    def take_state_copies(self) -> list[tuple[int, int]]:
        """The queued (from row, to row) state copies, for the runner to make now (between steps, in order)."""
        copies, self.state_copies = self.state_copies, []
        return copies

    def _reserve(self, request: Request, num_new: int, preempt: bool) -> int:
        """Pages for the request's next num_new tokens (fewer where a windowed group is short: see
        `CacheGroupBlocks.fit`); with `preempt`, newer running requests give theirs up. Returns the tokens that got
        pages, 0 for none."""
        if not request.block_tables:
            request.block_tables = self.blocks.new_tables()
        while (granted := self.blocks.fit(request.block_tables, request.num_computed, num_new)) < num_new:
            victim = self.running[-1] if preempt and self.running else None
            if victim is None or victim is request:
                break
            self.preempt(victim)
        if granted:
            self.blocks.allocate(request.block_tables, request.num_computed + granted)
        return granted

    def preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        self.waiting.appendleft(request)

    def finish(self, request: Request, reason: str) -> None:
        request.finish_reason = reason
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)

    def _release(self, request: Request) -> None:
        if self.blocks.state_slots is not None:
            self.blocks.state_slots.free(request.state_slot)
        request.state_slot = -1
        self.blocks.free(request.block_tables)
        request.block_tables, request.num_computed, request.num_published = [], 0, 0
