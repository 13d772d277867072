"""Engine scenarios over KV cache groups, shared by the engine tests of each model with windowed and full layers
(gpt-oss in test_cache_groups.py, MiMo-V2-Flash in test_mimo_v2_flash.py): a tiny checkpoint on the CPU reference
path with pages of `BLOCK` tokens, requests batched, chunked, prefix-cached and preempted, each checked against its
solo tokens, and the windowed group's released pages poisoned with NaN so that a read of one shows."""

from __future__ import annotations

from dataclasses import replace

from hybrid.block_manager import CacheGroupBlocks

BLOCK = 4  # tokens a page: prompts of a few pages cross page boundaries and windows of about three pages
MAX_STEPS = 2000  # far more than any scenario here takes: an engine stuck without pages fails instead of hanging


def steps(engine):
    """Steps the engine until its requests are done (yields after each step's outputs); fails after MAX_STEPS."""
    for _ in range(MAX_STEPS):
        if not engine.has_work():
            return
        yield engine.step()
    raise AssertionError(f"the engine still has work after {MAX_STEPS} steps: stuck (pages leaked?)")


def make_llm(path, **options):
    from hybrid import LLM

    return LLM(path, dtype="float32", expert_placement="device", block_size=BLOCK, **options)


def windowed_group(llm) -> int:
    return next(i for i, g in enumerate(llm.blocks.groups) if g.is_windowed)


def full_group(llm) -> int:
    return next(i for i, g in enumerate(llm.blocks.groups) if not g.is_windowed)


def poison_free_windowed_pages(llm) -> None:
    """NaN into every windowed page nobody holds (page 0 included when free: released entries point there)."""
    import torch

    group = windowed_group(llm)
    free = torch.tensor(list(llm.blocks.allocators[group]._free), dtype=torch.long)
    for layer in llm.model.attention_layers():
        if layer.cache_group == group:
            for part in layer.kv_cache:
                part[free] = float("nan")


def solo_outputs(llm, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Each prompt's greedy tokens, alone."""
    return [llm.generate(p, m, ignore_eos=True) for p, m in zip(prompts, max_tokens, strict=True)]


def batched_outputs(llm, prompts: list[list[int]], max_tokens: list[int], max_num_batched_tokens: int,
                    max_num_seqs: int) -> tuple[list[list[int]], int]:
    """The prompts added together to one engine (continuous batching, prefills chunked to the budget), the
    windowed group's free pages poisoned after every step: each request's tokens and the number of steps that ran
    more than one request. Every page is back in its pool at the end."""
    from hybrid.engine import Engine

    engine = Engine(llm, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)
    ids = [engine.add_request(p, max_tokens=m, ignore_eos=True) for p, m in zip(prompts, max_tokens, strict=True)]
    num_mixed = 0
    for outputs in steps(engine):
        num_mixed += len(outputs) > 1
        poison_free_windowed_pages(llm)
    outputs = [engine.requests[i].output_ids for i in ids]
    assert llm.blocks.num_free == llm.blocks.num_blocks
    engine.close()
    return outputs, num_mixed


def prefix_hit(llm, reference, conversation: list[int], max_tokens: int, follow_up: list[int], new_tokens: int):
    """`conversation` generated (its decode releasing windowed pages), then sent again with `follow_up` appended:
    the second request (its `num_cached` says how much of it the prefix cache gave) and the tokens the `reference`
    LLM (of the same checkpoint, without a prefix cache: `llm`'s own generate could hit the cache too) gives it."""
    from hybrid.engine import Engine

    assert not reference.blocks.enable_prefix_caching
    engine = Engine(llm, max_num_batched_tokens=16)
    engine.add_request(conversation, max_tokens=max_tokens, ignore_eos=True)
    for _ in steps(engine):
        pass
    resent = conversation + follow_up
    request_id = engine.add_request(resent, max_tokens=new_tokens, ignore_eos=True)
    for _ in steps(engine):
        pass
    request = engine.requests[request_id]
    engine.close()
    return request, reference.generate(resent, new_tokens, ignore_eos=True)


def preempted_outputs(llm, prompts: list[list[int]], max_tokens: list[int], num_blocks: dict[int | None, int],
                      max_num_batched_tokens: int = 32) -> tuple[list[list[int]], list[int]]:
    """The prompts together in an engine whose groups hold `num_blocks[sliding_window]` pages (too few for all of
    them, no prefix cache): each request's tokens and the ids of the requests preempted (each time one was).
    Every page is back in its pool at the end."""
    from hybrid.engine import Engine

    engine = Engine(llm, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=len(prompts))
    groups = [replace(g, num_blocks=num_blocks[g.sliding_window]) for g in llm.blocks.groups]
    engine.blocks = engine.scheduler.blocks = CacheGroupBlocks(groups, BLOCK, enable_prefix_caching=False)
    preempted = []
    preempt = engine.scheduler.preempt
    engine.scheduler.preempt = lambda r: preempted.append(r.request_id) or preempt(r)
    ids = [engine.add_request(p, max_tokens=m, ignore_eos=True) for p, m in zip(prompts, max_tokens, strict=True)]
    for _ in steps(engine):
        pass
    assert engine.blocks.num_free == engine.blocks.num_blocks
    outputs = [engine.requests[i].output_ids for i in ids]
    engine.close()
    return outputs, preempted


def pages_in_use(llm, prompt_ids: list[int], max_tokens: int) -> list[tuple[int, int, int]]:
    """One request alone in an engine: after each step that leaves it running, (tokens computed, windowed pages in
    use, full pages in use), the windowed ones checked exactly: the pages from the first one the step's first token
    sees through its last token's."""
    from hybrid.block_manager import blocks_needed
    from hybrid.engine import Engine

    windowed, full = windowed_group(llm), full_group(llm)
    engine = Engine(llm)
    request_id = engine.add_request(prompt_ids, max_tokens=max_tokens, ignore_eos=True)
    used = []
    before = 0
    for _ in steps(engine):
        request = engine.requests[request_id]
        if not request.is_finished:
            first_seen = llm.blocks.groups[windowed].first_needed_page(before, BLOCK)
            assert llm.blocks.num_used(windowed) == blocks_needed(request.num_computed, BLOCK) - first_seen
            used.append((request.num_computed, llm.blocks.num_used(windowed), llm.blocks.num_used(full)))
        before = request.num_computed
    engine.close()
    assert llm.blocks.num_free == llm.blocks.num_blocks
    return used
