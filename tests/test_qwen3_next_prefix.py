"""Prefix caching for models with recurrent layers (Qwen3-Next, Qwen3.5): a hit resumes the Gated DeltaNet states
from a snapshot kept at a page boundary (`hybrid.block_manager.StateSnapshotPool`), so a resent conversation is
computed only from the latest snapshot at or before its attention-page hit on, in every layer, and gives the
tokens of a run without prefix caching (`state_snapshots=0`). Snapshot bookkeeping, eviction and fallback to an
earlier snapshot or to none, batching, preemption, and the CUDA-graph engine on a GPU."""

from __future__ import annotations

import pytest
import torch
from qwen3_next_support import CHUNK, make_llm, random_prompt, write_qwen3_5, write_qwen3_next

from hybrid.block_manager import CacheGroupBlocks, PrefixCachingBlockManager, StateSnapshotPool
from hybrid.cache_groups import CacheGroup
from hybrid.engine import Engine

transformers = pytest.importorskip("transformers")

BLOCK = 16  # the engine config's default block_size


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_next")
    write_qwen3_next(transformers, path)
    return path


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5")
    write_qwen3_5(transformers, path)
    return path


def _keys(num_pages: int, seed: int = 0) -> list[bytes]:
    keys: list[bytes] = []
    PrefixCachingBlockManager(1, BLOCK).extend_keys(keys, random_prompt(num_pages * BLOCK, seed), num_pages * BLOCK)
    return keys


def test_snapshot_pool_bookkeeping():
    """Rows after the state slots; a key kept once; least recently used evicted; a rolling snapshot reuses its own
    row; a page leaving the prefix cache takes its snapshot with it."""
    k = _keys(6)
    pool = StateSnapshotPool(2, first_row=3)
    assert (pool.take(k[0]), pool.take(k[0]), pool.take(k[1])) == (3, None, 4)
    assert pool.latest(k, 6) == 2 and pool.latest(k, 1) == 1 and pool.latest(k[2:], 4) == 0
    assert pool.use(k[0]) == 3  # now the most recently used: k[1] goes first
    assert pool.take(k[2]) == 4 and pool.latest(k, 2) == 1
    assert pool.take(k[3], replacing=k[2]) == 4 and pool.latest(k, 3) == 1  # rolled: k[2] is gone
    assert pool.take(k[4], replacing=k[2]) == 3 and pool.num_cached == 2  # k[2] no longer kept: evicts k[0]
    pool.drop(k[3])
    assert pool.latest(k, 4) == 0 and pool.take(k[5]) == 4
    assert StateSnapshotPool(0, first_row=3).take(k[0]) is None


def test_match_prefix_stops_at_the_latest_snapshot():
    """A hit covers the cached pages only up to the latest snapshot among them; pages after it are not referenced
    (the request recomputes them into pages of its own). Evicting a page drops the snapshot keyed by it; without
    snapshots a model with state slots has no prefix caching."""
    group = CacheGroup((0,), ((2, 8), (2, 8)), None, 6)
    blocks = CacheGroupBlocks([group], BLOCK, num_state_slots=1, num_state_snapshots=2)
    keys = _keys(4)
    tables = blocks.new_tables()
    blocks.allocate(tables, 4 * BLOCK)
    blocks.cache_pages(tables, 0, 4, keys)
    blocks.free(tables)
    assert blocks.match_prefix(keys)[0] == 0  # pages cached, but no state to resume from
    assert blocks.snapshots.take(keys[1]) == 1  # row 1: after the one state slot
    num_pages, hit = blocks.match_prefix(keys)
    assert num_pages == 2 and hit == [tables[0][:2]] and blocks.num_free == 4
    blocks.free(hit)
    blocks.allocate(blocks.new_tables(), 6 * BLOCK)  # hands out every page, the snapshot's among them
    assert blocks.snapshots.num_cached == 0
    off = CacheGroupBlocks([group], BLOCK, num_state_slots=1, num_state_snapshots=0)
    assert not off.enable_prefix_caching and off.snapshots is None


def test_state_copies_apply_in_order():
    """The runner batches the queued row copies, yet a copy that reads or rewrites an earlier one's target runs after
    it: the last copy to a row wins, and a row copied on carries what was just copied into it."""
    from types import SimpleNamespace

    from hybrid.model_runner import ModelRunner

    pools = (torch.arange(5.0).repeat_interleave(4).view(5, 2, 2), torch.arange(5.0).view(5, 1, 1))
    runner = ModelRunner.__new__(ModelRunner)
    runner.device, runner.llm = "cpu", SimpleNamespace(state_caches=[pools])
    runner.copy_states([(0, 2), (1, 2), (2, 3), (4, 0)])
    assert [pool.flatten(1)[:, 0].tolist() for pool in pools] == [[4.0, 1.0, 1.0, 1.0, 4.0]] * 2


def _generate(engine, prompts, max_tokens):
    """Runs the prompts together; (their output ids, the requests)."""
    ids = [engine.add_request(p, max_tokens=max_tokens, ignore_eos=True) for p in prompts]
    while engine.has_work():
        engine.step()
    requests = [engine.requests.pop(i) for i in ids]
    return [r.output_ids for r in requests], requests


def _without_prefix_caching(path, requests):
    """Each (prompt, max_tokens) alone through an engine with no snapshots (so no prefix caching): the reference
    tokens."""
    llm = make_llm(path, state_snapshots=0)
    engine = Engine(llm, max_num_batched_tokens=CHUNK, max_num_seqs=1)
    try:
        outputs = [_generate(engine, [p], max_tokens)[0][0] for p, max_tokens in requests]
        stats = engine.stats()
        assert not llm.blocks.enable_prefix_caching
        assert (stats.num_cached_tokens, stats.num_snapshot_hits, stats.num_state_snapshots) == (0, 0, 0)
        return outputs
    finally:
        engine.close()


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_multi_turn_resend_hits_every_layer(arch, request):
    """Turn 1: a 40-token prompt and 20 tokens of reply, 59 tokens computed: its decode passed the page boundary at
    48 and kept the state there. Turn 2 resends prompt + reply + a new turn: the pages and the states at 48 are
    reused, so every layer computes only from position 48 on, and the tokens equal a run without the cache."""
    path = request.getfixturevalue(arch)
    first = random_prompt(40, seed=1)
    llm = make_llm(path)
    engine = Engine(llm, max_num_batched_tokens=CHUNK, max_num_seqs=2)
    try:
        reply = _generate(engine, [first], 20)[0][0]
        resent = first + reply + random_prompt(11, seed=2)  # 71 tokens
        forward_tokens = llm.num_forward_tokens
        (tokens,), (second,) = _generate(engine, [resent], 8)
        stats = engine.stats()
    finally:
        engine.close()
    assert second.num_cached == 48 and (stats.num_cached_tokens, stats.num_snapshot_hits) == (48, 1)
    assert llm.num_forward_tokens - forward_tokens == len(resent) - 48 + 7  # the prefix ran in no layer
    assert [reply, tokens] == _without_prefix_caching(path, [(first, 20), (resent, 8)])


def test_evicted_snapshot_falls_back(qwen3_next):
    """Two snapshots: turn 1 (40 + 20 tokens) keeps its prompt's last boundary (32) and its decode's (48); a request
    that hits at 32 keeps that one in use; an unrelated request then evicts the one at 48. The resent conversation's
    pages still hit at 48, but it resumes from the snapshot at 32 and recomputes the rest; once that is gone too, it
    recomputes everything. Every run gives the tokens of a run without the cache."""
    first = random_prompt(40, seed=11)
    llm = make_llm(qwen3_next, state_snapshots=2)
    engine = Engine(llm, max_num_batched_tokens=CHUNK, max_num_seqs=2)
    try:
        reply = _generate(engine, [first], 20)[0][0]
        branch = first + random_prompt(5, seed=12)  # hits at 32
        (branched,), (request,) = _generate(engine, [branch], 2)
        assert request.num_cached == 32
        other = random_prompt(40, seed=13)  # 40 + 4 tokens: keeps only its own boundary at 32, evicting 48
        _generate(engine, [other], 4)
        resent = first + reply + random_prompt(11, seed=14)
        (falls_back,), (request,) = _generate(engine, [resent], 6)
        assert request.num_cached == 32 and engine.blocks.snapshots.num_cached == 2
        _generate(engine, [random_prompt(40, seed=15), random_prompt(40, seed=16)], 4)  # evicts both
        (recomputed,), (request,) = _generate(engine, [resent], 6)
        assert request.num_cached == 0
    finally:
        engine.close()
    assert [branched, falls_back, recomputed] == _without_prefix_caching(qwen3_next, [(branch, 2), (resent, 6),
                                                                                      (resent, 6)])


def test_batched_resends_with_hits(qwen3_next):
    """Two conversations, then both resent in one batch beside a new prompt and a one-token prompt, with chunked
    prefill: each hit resumes from its own snapshot, and every request gets its tokens of a run without the
    cache."""
    llm = make_llm(qwen3_next)
    engine = Engine(llm, max_num_batched_tokens=CHUNK, max_num_seqs=4)
    firsts = [random_prompt(35, seed=21), random_prompt(50, seed=22)]
    try:
        replies = _generate(engine, firsts, 16)[0]
        resent = [first + reply + random_prompt(9, seed=23 + i)
                  for i, (first, reply) in enumerate(zip(firsts, replies, strict=True))]
        prompts = [resent[0], random_prompt(70, seed=25), resent[1], random_prompt(1, seed=26)]
        tokens, requests = _generate(engine, prompts, 5)
        stats = engine.stats()
    finally:
        engine.close()
    # turn 1 ended after 50 and 65 computed tokens: their decodes kept the states at 48 and 64
    assert [r.num_cached for r in requests] == [48, 0, 64, 0] and stats.num_snapshot_hits == 2
    assert tokens == _without_prefix_caching(qwen3_next, [(p, 5) for p in prompts])
    assert stats.num_free_state_slots == stats.num_state_slots


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graph_engine_resend_hits(tmp_path):
    """On the GPU (bf16, the Triton kernels, CUDA-graph decode): snapshots are copied between steps, outside the
    graphs. Turn 1 is a 48-token prompt, so the snapshot at 48 comes from the same prefill chunks (of 16) the
    engine without the cache runs: resending it with more turns, one request at a time, computes the same chunks
    from the same states and gives the same tokens, bit for bit."""
    write_qwen3_next(transformers, tmp_path, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64,
                     linear_num_key_heads=1, linear_num_value_heads=2)
    first = random_prompt(48, seed=31)
    outputs = {}
    for snapshots in (0, 4):
        llm = make_llm(tmp_path, device="cuda", dtype="bfloat16", kernels="triton", state_snapshots=snapshots)
        engine = Engine(llm, max_num_batched_tokens=16, max_num_seqs=4)
        try:
            reply = _generate(engine, [first], 1)[0][0]
            results = [_generate(engine, [first + reply + random_prompt(n, seed=32 + n)], 24) for n in (8, 2)]
            assert engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0
            outputs[snapshots] = [tokens[0] for tokens, _ in results], [r[0].num_cached for _, r in results]
        finally:
            engine.close()
    assert outputs[4][1] == [48, 48] and outputs[0][1] == [0, 0]
    assert outputs[4][0] == outputs[0][0]
