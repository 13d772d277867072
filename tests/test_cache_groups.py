"""KV cache groups: layers grouped by page shape and window, one allocator per group, sliding-window pages given
back while a request runs; the scheduler and prefix cache over every group; one model runner for the engine,
`LLM.generate` and `LLM.prefill_logits`.

Bookkeeping tests need no torch. Engine tests use a tiny gpt-oss (window 12, pages of 4 tokens, sliding and full
layers in an irregular order) on the CPU reference path: batched, chunked, prefix-cached and preempted requests
get exactly their solo tokens, the windowed group's pages in use stay bounded while the full group's grow, and a
released page is never read (its contents are poisoned with NaN)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
from cache_groups_support import (
    BLOCK,
    batched_outputs,
    make_llm,
    pages_in_use,
    poison_free_windowed_pages,
    preempted_outputs,
    prefix_hit,
    solo_outputs,
)
from checkpoints import prompt

from hybrid.block_manager import NULL_PAGE, CacheGroupBlocks, blocks_needed
from hybrid.cache_groups import CacheGroup, ceil_div, derive_cache_groups, windowed_blocks
from hybrid.sampling import SamplingParams
from hybrid.scheduler import Request, Scheduler

WINDOW = 12


def fake_layer(kv_heads: int, qk_dim: int, v_dim: int, window: int | None):
    return SimpleNamespace(kv_cache_shapes=lambda: ((kv_heads, qk_dim), (kv_heads, v_dim)),
                           cfg=SimpleNamespace(sliding_window=window))


def test_groups_follow_page_shape_and_window():
    """gpt-oss: one windowed and one full group; MiMo-like layers (4 or 8 KV heads, qk 192 / v 128, windowed and
    full) split by shape too. Windowed pools hold each sequence's window plus the step's chunk, capped at full."""
    gpt_oss = [fake_layer(8, 64, 64, 128 if i % 2 == 0 else None) for i in range(6)]
    groups = derive_cache_groups(gpt_oss, 1024, 16, max_num_seqs=8, max_num_batched_tokens=512)
    assert [(g.layer_indices, g.sliding_window) for g in groups] == [((0, 2, 4), 128), ((1, 3, 5), None)]
    assert groups[0].num_blocks == 8 * (ceil_div(127, 16) + 2) + 32 == windowed_blocks(128, 16, 8, 512)
    assert groups[1].num_blocks == 1024
    mimo = [fake_layer(4, 192, 128, None), fake_layer(8, 192, 128, 128), fake_layer(8, 192, 128, 128),
            fake_layer(8, 192, 128, None), fake_layer(4, 192, 128, 128)]
    groups = derive_cache_groups(mimo, 64, 16, max_num_seqs=64, max_num_batched_tokens=512)
    assert [g.layer_indices for g in groups] == [(0,), (1, 2), (3,), (4,)]
    assert groups[1].page_shapes == ((8, 192), (8, 128)) and groups[1].num_blocks == 64  # capped at full


def test_bookkeeping_needs_no_torch():
    code = "import sys, hybrid.block_manager, hybrid.cache_groups; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def two_groups(num_windowed: int = 40, num_full: int = 40, window: int = 8) -> CacheGroupBlocks:
    groups = [CacheGroup((0,), ((1, 4),), window, num_windowed), CacheGroup((1,), ((1, 4),), None, num_full)]
    return CacheGroupBlocks(groups, BLOCK)


def test_pages_before_the_window_are_released_exactly():
    """Window 8, pages of 4: the token at position p sees p - 7 .. p, so page 0 (positions 0-3) goes back once
    the next token is at 11, not at 10; the full group keeps everything."""
    blocks = two_groups()
    tables = blocks.new_tables()
    blocks.allocate(tables, 16)
    windowed = list(tables[0])
    blocks.release_out_of_window(tables, 10)
    assert tables[0] == windowed and blocks.num_used(0) == 4
    blocks.release_out_of_window(tables, 11)
    assert tables[0] == [NULL_PAGE] + windowed[1:] and blocks.num_used(0) == 3
    blocks.release_out_of_window(tables, 16)  # token 16 sees 9..16: pages 0 and 1 out
    assert tables[0][:2] == [NULL_PAGE, NULL_PAGE] and tables[0][2:] == windowed[2:]
    assert len(tables[1]) == 4 and blocks.num_used(1) == 4
    blocks.free(tables)
    assert blocks.num_free == blocks.num_blocks


def test_prefix_hit_needs_full_pages_and_the_window_tail():
    """Keys are shared by the groups. A hit of P pages needs every full page before P and, in the windowed group,
    only the pages the token at P can see; windowed pages lost to other users shorten the hit."""
    blocks = two_groups(num_windowed=6, num_full=10)
    keys: list[bytes] = []
    tokens = list(range(24))
    blocks.extend_keys(keys, tokens, 24)
    tables = blocks.new_tables()
    blocks.allocate(tables, 24)
    blocks.cache_pages(tables, 0, 6, keys)
    windowed = list(tables[0])
    num_pages, hit = blocks.match_prefix(keys)
    assert num_pages == 6 and hit[0][:4] == [NULL_PAGE] * 4 and hit[0][4:] == windowed[4:]
    assert hit[1] == tables[1]
    blocks.free(hit)
    blocks.free(tables)  # every page cached and free; the windowed group hands out its last pages first
    blocks.allocators[0].allocate(2)  # another user takes (and overwrites) windowed pages 5 and 4
    num_pages, hit = blocks.match_prefix(keys)
    assert num_pages == 4  # P = 16 tokens: the token at 16 sees 9..16, pages 2 and 3
    assert hit[0] == [NULL_PAGE, NULL_PAGE] + windowed[2:4] and len(hit[1]) == 4


def request(request_id: int, num_prompt: int, max_tokens: int = 4) -> Request:
    return Request(request_id, prompt(num_prompt, seed=request_id), SamplingParams(), max_tokens)


def test_scheduler_reserves_releases_and_preempts_over_every_group():
    """A windowed pool short of pages shrinks a prefill chunk instead of failing it; running out of full pages
    preempts the newest request, whose pages go back in every group; a request no group can ever hold is refused."""
    blocks = two_groups(num_windowed=6, num_full=14)
    scheduler = Scheduler(blocks, max_num_batched_tokens=64, max_num_seqs=4)
    first = request(0, 40)
    scheduler.add(first)
    (chunk,) = scheduler.schedule()
    assert chunk.num_new == 24  # 6 windowed pages: positions 0-23
    scheduler.advance(first, chunk.num_new)
    (chunk,) = scheduler.schedule()  # pages 0-3 released (token 24 sees 17..24): 16 more tokens fit
    assert chunk.num_new == 16 and first.block_tables[0][:4] == [NULL_PAGE] * 4
    scheduler.advance(first, chunk.num_new)
    first.output_ids.append(5)  # sampled from the last chunk: first decodes from now on
    second = request(1, 7)
    scheduler.add(second)
    chunks = scheduler.schedule()
    assert [c.request for c in chunks] == [first, second]
    for c in chunks:
        scheduler.advance(c.request, c.num_new)
    used = [blocks.num_used(0), blocks.num_used(1)]
    scheduler.preempt(second)
    assert blocks.num_used(1) == used[1] - 2 and blocks.num_used(0) == used[0] - 2
    assert second.block_tables == [] and second.num_computed == 0
    with pytest.raises(ValueError, match="cache group 1"):
        scheduler.add(request(2, 60, max_tokens=1))


@pytest.fixture(scope="module")
def gpt_oss_path(tmp_path_factory):
    from test_gpt_oss import make_gpt_oss

    path = tmp_path_factory.mktemp("gpt_oss_groups")
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 1024}  # 4096 positions for the long request
    make_gpt_oss(path, sliding_window=WINDOW, max_position_embeddings=4096, rope_parameters=rope)
    return path


@pytest.fixture(scope="module")
def llm(gpt_oss_path):
    return make_llm(gpt_oss_path, max_model_len=256)


PROMPTS = [prompt(n, seed=700 + n) for n in (3, 11, 13, 29, 40, 8)]  # around pages (4) and the window (12)
MAX_TOKENS = [14, 9, 5, 12, 7, 20]


@pytest.fixture(scope="module")
def solo(llm):
    return solo_outputs(llm, PROMPTS, MAX_TOKENS)


def test_gpt_oss_groups(llm):
    assert [g.sliding_window for g in llm.blocks.groups] == [WINDOW, None]
    layers = llm.model.attention_layers()
    assert [layers[i].cfg.sliding_window for i in llm.blocks.groups[0].layer_indices] == [WINDOW] * 3
    assert all(layers[i].cache_group == 1 for i in llm.blocks.groups[1].layer_indices)


@pytest.fixture(scope="module")
def uncached(gpt_oss_path):
    return make_llm(gpt_oss_path, max_model_len=256, enable_prefix_caching=False)


def test_continuous_batching_and_chunked_prefill_match_solo(uncached, solo):
    """Chunks of a 10-token budget cross pages and windows beside other requests' decodes; each request gets its
    solo tokens although the windowed pages it released are poisoned after every step (no prefix cache here:
    a cached page may be read again)."""
    outputs, num_mixed = batched_outputs(uncached, PROMPTS, MAX_TOKENS, max_num_batched_tokens=10, max_num_seqs=4)
    assert num_mixed > 0
    assert outputs == solo


def test_prefix_cache_hit_gives_identical_output(llm, uncached):
    conversation = PROMPTS[4]  # 40 tokens: 10 pages; decoding releases the windowed group's early pages
    request, alone = prefix_hit(llm, uncached, conversation, MAX_TOKENS[4], [7, 9, 11], 6)
    assert request.num_cached == 40
    assert request.output_ids == alone


def test_preemption_and_resume_are_exact(gpt_oss_path, solo):
    """Pools of 16 full and 6 windowed pages cannot hold the requests together: some are preempted and computed
    again, chunks shrink to the windowed pool, and every request still gets its solo tokens."""
    llm = make_llm(gpt_oss_path, max_model_len=256)
    chosen = [0, 1, 3, 4]  # up to 40 + 7 tokens: 12 full pages
    outputs, preempted = preempted_outputs(llm, [PROMPTS[i] for i in chosen], [MAX_TOKENS[i] for i in chosen],
                                           {None: 16, WINDOW: 6})
    assert preempted
    assert outputs == [solo[i] for i in chosen]


def test_long_request_keeps_only_its_window(gpt_oss_path):
    """A 4K-token gpt-oss request, measured: the windowed group holds exactly the pages from the window of each
    step's first token to its last token (at most the window's pages plus the step's chunk) while the full group
    grows with the context, so its KV costs full-attention memory on the full layers only."""
    from hybrid.kv_cache import page_bytes

    llm = make_llm(gpt_oss_path, max_model_len=4096, max_num_seqs=1, max_num_batched_tokens=512)
    windowed, full = llm.blocks.groups
    assert windowed.num_blocks == windowed_blocks(WINDOW, BLOCK, 1, 512) < full.num_blocks
    used = pages_in_use(llm, prompt(4000, seed=4), 6)
    assert all(num_full == blocks_needed(num_computed, BLOCK) for num_computed, _, num_full in used)
    assert max(u[1] for u in used) <= ceil_div(WINDOW - 1, BLOCK) + 1 + 512 // BLOCK  # prefill: window + chunk
    assert used[-1][1] <= ceil_div(WINDOW - 1, BLOCK) + 1  # decoding: the window's pages
    assert used[-1][2] >= blocks_needed(4004, BLOCK)
    window_bytes = used[-1][1] * page_bytes(windowed, BLOCK, llm.engine_config.torch_dtype)
    full_bytes = used[-1][2] * page_bytes(full, BLOCK, llm.engine_config.torch_dtype)
    assert window_bytes * 100 < full_bytes  # 3 windowed layers over ~16 tokens, 2 full ones over 4004


def test_llm_and_engine_share_one_allocator_and_one_step_path(gpt_oss_path, monkeypatch):
    """LLM.generate, LLM.prefill_logits and Engine.step take pages from the one `llm.blocks` and prepare and run
    every step through `ModelRunner.execute` and `StepInputs.prepare`. prefill_logits of a prompt longer than the
    windowed pool runs in chunks, releasing pages between them: the same logits as one step."""
    import torch

    from hybrid.engine import Engine
    from hybrid.forward_batch import StepInputs
    from hybrid.model_runner import ModelRunner

    calls = []
    execute, prepare = ModelRunner.execute, StepInputs.prepare.__func__
    monkeypatch.setattr(ModelRunner, "execute", lambda self, *a, **k: calls.append(self) or execute(self, *a, **k))
    monkeypatch.setattr(StepInputs, "prepare", classmethod(lambda cls, *a: calls.append("prepare") or
                                                           prepare(cls, *a)))
    llm = make_llm(gpt_oss_path, max_model_len=96, max_num_seqs=1, max_num_batched_tokens=16)
    assert llm.blocks.groups[0].num_blocks * BLOCK < 90  # the windowed pool cannot take 90 tokens at once
    whole = make_llm(gpt_oss_path, max_model_len=96)
    ids = prompt(90, seed=5)
    assert torch.allclose(llm.prefill_logits(ids), whole.prefill_logits(ids), atol=1e-5, rtol=0)
    assert calls.count(llm.runner) > 1 and calls.count("prepare") == calls.count(llm.runner) + 1
    calls.clear()
    llm.generate(PROMPTS[1], 3, ignore_eos=True)
    engine = Engine(llm, max_num_batched_tokens=16)
    assert engine.blocks is llm.blocks is engine.scheduler.blocks and engine.runner is llm.runner
    engine.generate([PROMPTS[2]], max_tokens=3, ignore_eos=True)
    assert set(calls) == {llm.runner, "prepare"} and calls.count("prepare") == calls.count(llm.runner)
    assert llm.blocks.num_free == llm.blocks.num_blocks


@pytest.mark.parametrize("query_len", [1, 4])
def test_kernels_never_read_pages_before_the_window(query_len):
    """The Triton kernels (decode and prefill; the interpreter without a GPU) given a table whose pages before the
    first query's window point at a page of NaN, as a released windowed page's entry may: the output of the
    intact table, the reference's too. Pages of 4 under key tiles of 16 put released pages inside the first tile."""
    import torch
    from gpu_support import DEVICE

    from gpu_layers import attention, reference

    gen = torch.Generator().manual_seed(3)
    seq_len, heads, kv_heads, dim, window = 40, 4, 2, 64, 12
    num_pages = blocks_needed(seq_len, BLOCK)
    k_cache, v_cache = (torch.randn(num_pages + 1, BLOCK, kv_heads, dim, generator=gen) for _ in range(2))
    k_cache[num_pages], v_cache[num_pages] = float("nan"), float("nan")
    q = torch.randn(query_len, heads, dim, generator=gen)
    intact = torch.arange(num_pages, dtype=torch.int32)[None]
    released = intact.clone()
    first_needed = (seq_len - query_len - window + 1) // BLOCK
    released[0, :first_needed] = num_pages  # what the block manager gives back, pointing at the NaN page
    args = dict(seq_lens=torch.tensor([seq_len], dtype=torch.int32), scale=dim ** -0.5, sliding_window=window)

    def run(table):
        on = {k: (v.to(DEVICE) if torch.is_tensor(v) else v) for k, v in args.items()}
        cache = (q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), table.to(DEVICE))
        if query_len == 1:
            return attention.paged_decode_attention(*cache, **on).cpu()
        starts = torch.tensor([0, query_len], dtype=torch.int32, device=DEVICE)
        return attention.paged_prefill_attention(*cache[:4], on["seq_lens"], starts, query_len, on["scale"],
                                                 window).cpu()

    want = reference.paged_attention(q, k_cache, v_cache, intact, [seq_len], [query_len], dim ** -0.5, window)
    got = reference.paged_attention(q, k_cache, v_cache, released, [seq_len], [query_len], dim ** -0.5, window)
    assert torch.equal(got, want)
    assert torch.allclose(run(released), want, atol=1e-4, rtol=0) and not run(released).isnan().any()


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="CUDA graphs need a GPU")
def test_gpt_oss_graph_engine_matches_eager_with_window_groups(tmp_path):
    """On CUDA with the Triton kernels (head dim 64, pages of 16, window 20): decode graphs read each cache
    group's static tables; the graph engine generates what the eager engine does, released pages poisoned."""
    from test_gpt_oss import make_gpt_oss

    from hybrid import LLM
    from hybrid.engine import Engine

    make_gpt_oss(tmp_path, sliding_window=20, head_dim=64)
    prompts = [prompt(n, seed=60 + n) for n in (5, 19, 23, 40)]
    outputs = {}
    for is_graph in (False, True):
        llm = LLM(tmp_path, device="cuda", dtype="bfloat16", kernels="triton", expert_placement="device",
                  cuda_graph=is_graph, enable_prefix_caching=False, max_model_len=128)
        assert llm.backends.attention.name == "triton" and len(llm.blocks.groups) == 2
        engine = Engine(llm, max_num_batched_tokens=16, max_num_seqs=4)
        ids = [engine.add_request(p, max_tokens=24, ignore_eos=True) for p in prompts]
        while engine.has_work():
            engine.step()
            poison_free_windowed_pages(llm)
        outputs[is_graph] = [engine.requests[i].output_ids for i in ids]
        assert (engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0) == is_graph
        engine.close()
    assert outputs[True] == outputs[False]
