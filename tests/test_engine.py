"""The engine loop on the CPU (float32, tiny Qwen3-MoE and DeepSeek-V3 checkpoints): continuous batching gives each
request exactly the tokens it gets alone, a prefix-cache hit gives identical output, cancellation frees every page,
and running out of KV pages queues requests instead of failing them."""

from __future__ import annotations

from dataclasses import replace

import pytest
from checkpoints import SEEDS, VARIANTS, make_checkpoint, prompt
from gpu_support import DEVICE

from hybrid import LLM
from hybrid.block_manager import CacheGroupBlocks, PrefixCachingBlockManager
from hybrid.engine import Engine
from hybrid.sampling import SamplingParams, apply_penalties

PROMPTS = [prompt(n, seed=300 + n) for n in (1, 5, 16, 17, 33, 40)]
MAX_TOKENS = [9, 4, 12, 1, 7, 10]


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_checkpoint(VARIANTS[request.param](), path, seed=SEEDS[request.param])
    return path


def alone(path, prompt_ids, max_tokens):
    return LLM(path, device="cpu", dtype="float32").generate(prompt_ids, max_tokens, ignore_eos=True)


def test_continuous_batching_matches_each_request_alone(checkpoint):
    """A token budget of 24 splits the long prompts into chunks that share steps with other requests' decodes."""
    llm = LLM(checkpoint, device="cpu", dtype="float32")
    engine = Engine(llm, max_num_batched_tokens=24, max_num_seqs=4)
    ids = [engine.add_request(p, max_tokens=m, ignore_eos=True) for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)]
    mixed_steps = 0
    while engine.has_work():
        outputs = engine.step()
        mixed_steps += len(outputs) > 1
    assert mixed_steps > 0
    for request_id, p, m in zip(ids, PROMPTS, MAX_TOKENS, strict=True):
        request = engine.requests[request_id]
        assert request.finish_reason == "length"
        assert request.output_ids == alone(checkpoint, p, m), request_id
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_seeded_request_is_the_same_alone_and_batched(checkpoint):
    """A seeded request draws from its own generator in the batched sampler: the tokens it gets alone (engine or
    LLM.generate) whatever three other requests (greedy, unseeded with penalties, another seed with logprobs) share
    its steps."""
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    llm = LLM(checkpoint, device="cpu", dtype="float32")
    want = llm.generate(PROMPTS[2], 8, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    assert Engine(llm).generate([PROMPTS[2]], params, max_tokens=8, ignore_eos=True) == [want]
    engine = Engine(llm, max_num_batched_tokens=24, max_num_seqs=4)
    requests = [(PROMPTS[5], SamplingParams()),
                (PROMPTS[0], SamplingParams(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5)),
                (PROMPTS[2], params),
                (PROMPTS[4], SamplingParams(temperature=0.7, seed=99, logprobs=2))]
    ids = [engine.add_request(p, q, max_tokens=8, ignore_eos=True) for p, q in requests]
    steps = []
    while engine.has_work():
        steps.append(engine.step())
    assert engine.requests[ids[2]].output_ids == want
    with_logprobs = [o for step in steps for o in step if o.request_id == ids[3]]
    assert len(with_logprobs) == 8 and all(o.logprob <= 0 and len(o.top_logprobs) == 2 for o in with_logprobs)
    assert all(o.logprob is None for step in steps for o in step if o.request_id != ids[3])


def test_prefix_cache_hit_gives_identical_output(checkpoint):
    llm = LLM(checkpoint, device="cpu", dtype="float32")
    engine = Engine(llm)
    conversation = PROMPTS[4] + PROMPTS[5]  # 73 tokens: 4 full pages of 16
    engine.generate([conversation], max_tokens=5, ignore_eos=True)
    # the same 4 full pages, then new tokens from position 64 on: a stale page's contents there are not the prompt's
    resent = conversation[:64] + [(t + 1) % 256 for t in conversation[64:]] + prompt(3, seed=9)
    request_id = engine.add_request(resent, max_tokens=6, ignore_eos=True)
    while engine.has_work():
        engine.step()
    request = engine.requests[request_id]
    assert request.num_cached == 64  # the conversation's full pages were not recomputed
    assert request.output_ids == alone(checkpoint, resent, 6)


def test_cancellation_frees_blocks(checkpoint):
    engine = Engine(LLM(checkpoint, device="cpu", dtype="float32"), max_num_batched_tokens=8)
    keep = engine.add_request(PROMPTS[2], max_tokens=3, ignore_eos=True)
    dropped = engine.add_request(PROMPTS[5], max_tokens=20, ignore_eos=True)
    engine.step()
    engine.step()
    assert engine.blocks.num_free < engine.blocks.num_blocks
    engine.cancel(dropped)
    while engine.has_work():
        engine.step()
    assert engine.requests[dropped].finish_reason == "cancelled"
    assert engine.requests[keep].output_ids == alone(checkpoint, PROMPTS[2], 3)
    assert engine.blocks.num_free == engine.blocks.num_blocks


class LetterTokenizer:
    """Token t decodes to two letters of its own ("ab", "bc", ...): a stop string can span two tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + t % 26) + chr(97 + (t + 1) % 26) for t in ids)


def test_stop_strings_end_the_request_and_free_its_pages(checkpoint):
    """A stop string spanning two tokens ends the request at the token that completes it, with the text cut before
    it and never streamed; a batched neighbour without stop strings goes on to max_tokens."""
    llm = LLM(checkpoint, device="cpu", dtype="float32")
    full = Engine(llm).generate([PROMPTS[2]], max_tokens=12, ignore_eos=True)[0]
    text = LetterTokenizer().decode(full)
    stop = text[9:12]  # the last letter of token 4 and token 5's two: completed by token 5 (if not earlier)
    first = text.find(stop)
    engine = Engine(llm, max_num_batched_tokens=24, tokenizer=LetterTokenizer())
    stopped = engine.add_request(PROMPTS[2], max_tokens=12, ignore_eos=True, stop=(stop,))
    other = engine.add_request(PROMPTS[4], max_tokens=12, ignore_eos=True)
    streamed = {stopped: "", other: ""}
    while engine.has_work():
        for output in engine.step():
            streamed[output.request_id] += output.text
    assert engine.requests[stopped].finish_reason == "stop"
    assert engine.requests[stopped].output_ids == full[:(first + len(stop) + 1) // 2]
    assert streamed[stopped] == text[:first]
    assert engine.requests[other].finish_reason == "length" and len(engine.requests[other].output_ids) == 12
    assert streamed[other] == LetterTokenizer().decode(engine.requests[other].output_ids)
    assert engine.blocks.num_free == engine.blocks.num_blocks
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        Engine(llm).add_request(PROMPTS[2], stop=("x",))


def test_kv_exhaustion_queues_requests(checkpoint):
    """8 pages of 16 tokens cannot hold the six requests at once: they wait, some are preempted and recomputed,
    and every one still gets its own tokens."""
    llm = LLM(checkpoint, device="cpu", dtype="float32", max_model_len=128)
    engine = Engine(llm, max_num_batched_tokens=64)
    groups = [replace(group, num_blocks=8) for group in llm.blocks.groups]
    engine.blocks = engine.scheduler.blocks = CacheGroupBlocks(groups, 16, enable_prefix_caching=False)
    ids = [engine.add_request(p, max_tokens=m, ignore_eos=True) for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)]
    max_waiting = 0
    while engine.has_work():
        engine.step()
        max_waiting = max(max_waiting, len(engine.scheduler.waiting))
    assert max_waiting > 0
    for request_id, p, m in zip(ids, PROMPTS, MAX_TOKENS, strict=True):
        assert engine.requests[request_id].output_ids == alone(checkpoint, p, m)


def test_prefix_cache_bookkeeping():
    blocks = PrefixCachingBlockManager(6, 4)
    tokens = list(range(10))  # 2 full pages
    keys = []
    blocks.extend_keys(keys, tokens, len(tokens))
    pages = blocks.allocate(3)
    blocks.cache_pages(pages[:2], keys)
    assert blocks.match_prefix(keys) == pages[:2]  # shared now: 2 references each
    assert blocks.match_prefix(keys[:1]) == pages[:1]
    blocks.free(pages)
    blocks.free(pages[:2])
    blocks.free(pages[:1])
    assert blocks.num_free == 6
    assert blocks.match_prefix(keys) == pages[:2]  # freed pages keep their contents until handed out again
    blocks.free(pages[:2])
    blocks.allocate(6)  # hands out every page: the cached contents are gone
    assert blocks.num_free == 0
    blocks.free(list(range(6)))
    assert blocks.match_prefix(keys) == []


def test_page_keys_are_chained_blake2b_digests():
    """A page's key is BLAKE2b-256 of its parent's key and its token ids (int64, little-endian): reproducible
    outside the process, collision-resistant, and covering every earlier token through the chain."""
    import hashlib

    blocks = PrefixCachingBlockManager(4, 2)
    keys = []
    blocks.extend_keys(keys, [5, 7, 9, 11, 13], 5)
    first = hashlib.blake2b((5).to_bytes(8, "little") + (7).to_bytes(8, "little"), digest_size=32).digest()
    second = hashlib.blake2b(first + (9).to_bytes(8, "little") + (11).to_bytes(8, "little"), digest_size=32).digest()
    assert keys == [first, second]
    other = []
    blocks.extend_keys(other, [6, 7, 9, 11], 4)  # the same second page after another first page
    assert other[1] != keys[1]
    blocks.extend_keys(keys, [5, 7, 9, 11, 13, 15], 6)  # only the new full page is hashed
    assert keys[:2] == [first, second] and len(keys) == 3


def test_each_full_page_is_hashed_once(checkpoint, monkeypatch):
    """Keys are computed when a page fills, not every step: a request of P full pages costs P digests however
    many decode steps it runs, and a resent conversation re-keys only what it adds."""
    import hybrid.block_manager as block_manager

    calls = []
    digest = block_manager.page_key
    monkeypatch.setattr(block_manager, "page_key", lambda parent, ids: calls.append(1) or digest(parent, ids))
    llm = LLM(checkpoint, device="cpu", dtype="float32")
    engine = Engine(llm, max_num_batched_tokens=24)
    conversation = PROMPTS[5]  # 40 tokens
    engine.generate([conversation], max_tokens=30, ignore_eos=True)  # 70 tokens, 69 computed: 4 full pages
    assert len(calls) == 4
    calls.clear()
    engine.generate([conversation], max_tokens=3, ignore_eos=True)  # a fresh request keys its prompt's 2 pages
    assert len(calls) == 2


def test_llm_and_engine_share_one_owner_of_pages(checkpoint):
    """LLM.generate and prefill_logits after an engine has run take pages from the engine's own block manager, so
    a conversation resent to the engine still finds its prefix intact and gets the same tokens."""
    llm = LLM(checkpoint, device="cpu", dtype="float32", kv_cache_tokens=96, max_model_len=96)
    engine = Engine(llm, max_num_batched_tokens=64)
    conversation = PROMPTS[4] + PROMPTS[5]  # 73 tokens: 4 full pages of 16
    first = engine.generate([conversation], max_tokens=5, ignore_eos=True)[0]
    assert llm.blocks is engine.blocks
    llm.generate(PROMPTS[5], 20, ignore_eos=True)  # 60 tokens: with 6 pages in all, it must reuse freed ones
    llm.prefill_logits(PROMPTS[5])
    request_id = engine.add_request(conversation, max_tokens=5, ignore_eos=True)
    while engine.has_work():
        engine.step()
    assert engine.requests[request_id].output_ids == first
    assert llm.blocks.num_free == llm.blocks.num_blocks
    engine.close()  # generate() then builds an engine of its own, on the same pages
    assert llm.engine is None and llm.generate(PROMPTS[1], 3, ignore_eos=True) == alone(checkpoint, PROMPTS[1], 3)
    assert llm.engine is not None and llm.engine.blocks is llm.blocks


def test_nan_logits_fail_only_their_request(checkpoint):
    """A poisoned embedding row makes every request holding that token produce NaN logits: it finishes with
    "error" and the cause, frees its pages, and its batch neighbour gets exactly its own tokens. LLM.generate
    raises instead of returning token 0."""
    import torch

    llm = LLM(checkpoint, device="cpu", dtype="float32")
    poisoned = PROMPTS[2][:5] + [255] + PROMPTS[2][5:]
    with torch.no_grad():
        llm.model.model.embed_tokens.weight[255] = float("nan")
    engine = Engine(llm, max_num_batched_tokens=64)
    bad = engine.add_request(poisoned, max_tokens=4, ignore_eos=True)
    good = engine.add_request(PROMPTS[3], max_tokens=4, ignore_eos=True)
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    failed = [o for o in outputs if o.request_id == bad]
    assert len(failed) == 1 and failed[0].finish_reason == "error" and "NaN or inf" in failed[0].error
    assert engine.requests[bad].output_ids == [] and engine.requests[bad].finish_reason == "error"
    assert engine.requests[good].output_ids == alone(checkpoint, PROMPTS[3], 4)
    assert engine.blocks.num_free == engine.blocks.num_blocks
    with pytest.raises(RuntimeError, match="NaN or inf"):
        llm.generate(poisoned, 2)


def test_penalties():
    import torch

    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, prompt_ids=[0], output_ids=[1, 2, 2], params=params)
    # token 0: prompt only, 2 / 2; token 1: -2 * 2 - 0.5 - 0.25; token 2: 1 / 2 - 0.5 - 0.5; token 3 untouched
    assert torch.allclose(out, torch.tensor([1.0, -4.75, -0.5, 0.5]))
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0)


def test_converted_model_overlaps_cpu_experts(tmp_path):
    """A converted model's CPU experts run on the executor thread while the shared expert runs: the same logits
    as calling them inline, and the engine batches it like any model."""
    import torch

    from convert.cli import main
    from cpu_experts.module import CpuExperts

    make_checkpoint(VARIANTS["deepseek_v3"](), tmp_path / "src", seed=SEEDS["deepseek_v3"])
    assert main([str(tmp_path / "src"), str(tmp_path / "dst"), "--expert-dtype", "int8"]) == 0
    llm = LLM(tmp_path / "dst", device="cpu", dtype="float32")
    modules = [m for m in llm.model.modules() if isinstance(m, CpuExperts)]
    assert modules and llm.cpu_executor is not None and llm.cpu_handoff.executor is llm.cpu_executor
    ids = PROMPTS[4]
    overlapped = llm.prefill_logits(ids)
    llm.cpu_handoff.executor = None  # inline
    inline = llm.prefill_logits(ids)
    assert torch.equal(overlapped, inline)
    llm.cpu_handoff.executor = llm.cpu_executor
    want = llm.generate(PROMPTS[1], 5, ignore_eos=True)
    assert Engine(llm).generate([PROMPTS[1], PROMPTS[3]], max_tokens=5, ignore_eos=True)[0] == want


def test_gpu_resident_experts_split_the_layer(tmp_path):
    """`gpu_experts=N`: each MoE layer keeps its N most routed experts (from a routing-statistics file) on the
    engine's device and the CPU operator sees them as -1; the sum is the layer's output (float activations, so
    both sides are exact to the stored weights), with the CPU part overlapped on its executor."""
    import torch

    from convert.cli import main
    from hybrid.placement import NO_ROW_LIMIT, RoutingStats
    from hybrid.routed_experts import RoutedExperts

    make_checkpoint(VARIANTS["deepseek_v3"](), tmp_path / "src", seed=SEEDS["deepseek_v3"])
    assert main([str(tmp_path / "src"), str(tmp_path / "dst"), "--expert-dtype", "int8"]) == 0
    args = dict(device="cpu", dtype="float32", expert_activations="float")
    recorder = LLM(tmp_path / "dst", **args).record_routing()
    recorder.add(1, torch.tensor([[3, 1], [6, -1]]))  # what a router call records: -1 is not counted
    assert recorder.stats().counts == {1: [0, 1, 0, 1, 0, 0, 1, 0]}
    # a graph step's padding rows (at or past the limit the graph runner sets) are not counted either
    recorder.limit_rows("cpu").fill_(1)
    recorder.add(1, torch.tensor([[3, 1], [6, 2]]))
    recorder.row_limit.fill_(NO_ROW_LIMIT)
    recorder.add(1, torch.tensor([[0, 7]]))
    assert recorder.stats().counts == {1: [1, 2, 0, 2, 0, 0, 1, 1]}
    counts = {layer: [0, 5, 1, 9, 0, 0, 7, 2] for layer in range(1, 4)}  # layers 1-3 are MoE
    RoutingStats(counts).write(tmp_path / "routing.json")
    split = LLM(tmp_path / "dst", gpu_experts=3, routing_stats=str(tmp_path / "routing.json"), **args)
    experts = [m for m in split.model.modules() if isinstance(m, RoutedExperts)]
    assert len(experts) == 3 and all(m.gpu_expert_ids == (1, 3, 6) and m.has_cpu_part for m in experts)
    whole = LLM(tmp_path / "dst", **args)
    ids = PROMPTS[4]
    got, want = split.prefill_logits(ids), whole.prefill_logits(ids)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    assert not torch.equal(experts[0].gate_proj.data[0], torch.zeros_like(experts[0].gate_proj.data[0]))
    assert split.generate(PROMPTS[1], 6, ignore_eos=True) == whole.generate(PROMPTS[1], 6, ignore_eos=True)
    recorded = whole.record_routing()
    whole.prefill_logits(ids)
    stats = recorded.stats()
    assert sorted(stats.counts) == [1, 2, 3]
    assert all(sum(c) == len(ids) * 3 for c in stats.counts.values())  # top-3 routing, every token counted


def test_gpu_resident_experts_through_the_fused_kernel(tmp_path):
    """On the kernel path in bf16 the GPU-resident experts run through gpu_layers.fused_moe (under the interpreter
    here): the split model stays as close to the unsplit one as bf16 allows."""
    from convert.cli import main
    from hybrid.routed_experts import RoutedExperts

    make_checkpoint(VARIANTS["qwen3_moe"](), tmp_path / "src", seed=SEEDS["qwen3_moe"])
    assert main([str(tmp_path / "src"), str(tmp_path / "dst"), "--expert-dtype", "int8"]) == 0
    args = dict(device=str(DEVICE), dtype="bfloat16", expert_activations="float", kernels="triton")
    split = LLM(tmp_path / "dst", gpu_experts=4, **args)
    experts = [m for m in split.model.modules() if isinstance(m, RoutedExperts) and m.has_cpu_part]
    assert experts and all(m.w_gate_up is not None for m in experts)  # fused: the kernel's layout
    whole = LLM(tmp_path / "dst", **args)
    got, want = split.prefill_logits(PROMPTS[3]), whole.prefill_logits(PROMPTS[3])
    assert float((got - want).norm() / want.norm()) < 2e-2


def test_expert_deferral_adds_the_lowest_experts_one_layer_later(tmp_path):
    """`defer_experts=1` on a converted model against the same model with its CPU experts called inline and MoE
    blocks that defer by hand: each token's lowest-weight expert of layers 1 and 2 lands in the next MoE layer's
    output, the last layer defers nothing. The exact model differs from both."""
    import types

    from convert.cli import main
    from hybrid.layers.moe import SparseMoE

    make_checkpoint(VARIANTS["deepseek_v3"](), tmp_path / "src", seed=SEEDS["deepseek_v3"])  # top-3, MoE 1-3
    assert main([str(tmp_path / "src"), str(tmp_path / "dst"), "--expert-dtype", "bf16"]) == 0
    args = dict(device="cpu", dtype="float32", expert_activations="float")
    deferred = LLM(tmp_path / "dst", defer_experts=1, **args)
    reference = LLM(tmp_path / "dst", **args)
    reference.cpu_handoff.executor = None  # inline
    carry = {}
    moe_blocks = [m for m in reference.model.modules() if isinstance(m, SparseMoE)]

    def by_hand(self, x):
        weights, ids = self.gate(x)
        is_late = weights.argsort(dim=1).argsort(dim=1) < 1  # rank 0: the token's lowest weight
        is_last = self is moe_blocks[-1]
        out = self.experts(x, ids if is_last else ids.masked_fill(is_late, -1), weights) + self._shared(x)
        if "late" in carry:
            out = out + carry.pop("late")
        if not is_last:
            carry["late"] = self.experts(x, ids.masked_fill(~is_late, -1), weights)
        return out

    for block in moe_blocks:
        block.forward = types.MethodType(by_hand, block)
    ids = PROMPTS[4]
    got, want = deferred.prefill_logits(ids), reference.prefill_logits(ids)
    exact = LLM(tmp_path / "dst", **args).prefill_logits(ids)
    scale = want.abs().max()
    assert (got - want).abs().max() <= 1e-5 * scale
    assert (got - exact).abs().max() > 1e-2 * scale
    with pytest.raises(ValueError, match="defer_experts 3 must be below"):
        LLM(tmp_path / "dst", defer_experts=3, **args)


def test_auto_gpu_experts_fills_what_is_left():
    from types import SimpleNamespace

    from hybrid.placement import auto_gpu_experts

    config = SimpleNamespace(hidden_size=64, moe_layers=(False, True, True),
                             moe=SimpleNamespace(intermediate_size=32, num_experts=8))
    expert = 3 * 64 * 32 * 2  # bf16 gate, up, down
    assert auto_gpu_experts(config, 10_000 + 2 * 5 * expert + expert, 9_000, 1_000, 2) == 5  # 5 per layer, 2 layers
    assert auto_gpu_experts(config, 10_000, 9_000, 2_000, 2) == 0  # nothing left
    assert auto_gpu_experts(config, 10**9, 0, 0, 2) == 8  # capped at the layer's experts


def test_record_routing_file_written_at_close(tmp_path):
    from hybrid.placement import RoutingStats

    make_checkpoint(VARIANTS["qwen3_moe"](), tmp_path / "src", seed=SEEDS["qwen3_moe"])
    llm = LLM(tmp_path / "src", device="cpu", dtype="float32", record_routing=str(tmp_path / "routing.json"))
    llm.prefill_logits(PROMPTS[2])
    llm.close()
    counts = RoutingStats.read(tmp_path / "routing.json").counts
    top_k = llm.config.moe.top_k
    assert counts and all(sum(c) == len(PROMPTS[2]) * top_k for c in counts.values())
