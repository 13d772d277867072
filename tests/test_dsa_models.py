"""DeepSeek Sparse Attention models against transformers' own modeling files: DeepSeek-V3.2
(`DeepseekV32ForCausalLM`, the indexer's rope in halves) and GLM-5 (`GlmMoeDsaForCausalLM`, interleaved, qk_nope
and v_head of other sizes), the GLM one with GLM-5.2's shared indexer layers. The tiny checkpoints are what
`save_pretrained` writes (the released names: `self_attn.indexer.{wq_b,wk,k_norm,weights_proj}`) plus the
multi-token-prediction layer the releases carry after the last layer (`with_mtp_layer`), which loading skips.

index_topk (16) is smaller than most prompts, so the indexer's selection decides the attention: transformers' own
logits move when top-k grows (checked), and ours follow. Top-k ties: our scores sum in another order than
transformers' (float32, about 1e-7 apart), so a selection could flip where two scores at the k-th place are that
close, and exact ties come from rows where every head's ReLU is zero for several keys (likelier with few heads,
hence 16). `selection_margins` measures every boundary gap of the prompts these tests use: the seeds are ones where
none is below 1e-5 of the row's largest score.

Checked: float32 prefill logits (1, 7, 33 and 200 tokens) within 1e-4 of max |logit| and 32 greedy tokens on the
CPU path, and through the Triton kernels (under the interpreter without a GPU) at 1, 7 and 33 tokens and 14 greedy
ones (every boundary, at the fewest interpreted tokens); the config in both GLM spellings of the indexer schedule;
batching with chunked prefill, prefix-cache hits and preemption give each request's solo tokens (the index-key
cache is part of the layer's pages); GLM indexer weights on shared layers skipped; the FP8 block releases (MTP
layer included) with the routed experts dequantized on the device and, FP8 as stored, on the CPU operator's native
FP8 kernels, and their `hybrid-convert` output computing the direct load's logits.
"""

from __future__ import annotations

import contextlib
import copy
import json
import shutil

import pytest
import torch
import transformers
from checkpoints import build_model, hf_generate, hf_logits, prompt
from float_checkpoints import round_expert_inputs
from safetensors.torch import load_file, save_file
from test_direct_serving import FLOAT_FORMAT_TOL
from test_fp8_checkpoint import build_fp8_checkpoint
from test_models_parity import assert_logits_close, assert_same_tokens

from convert.cli import main as convert_main
from cpu_experts.module import CpuExperts
from gpu_layers import dsa_reference
from hybrid import LLM
from hybrid.engine import Engine
from hybrid.errors import ConfigError
from hybrid.models import load_model_config

transformers.logging.set_verbosity_error()

TOPK = 16
PROMPT_LENS = (1, 7, 33, 200)
NUM_GREEDY = 32
NUM_KERNEL_GREEDY = 14  # from a 20-token prompt: decode's last step writes position 32 (a third page)
MAX_MODEL_LEN = 320
NUM_LAYERS = 4
GLM_INDEXER_TYPES = ["full", "shared", "full", "shared"]
COMMON = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=NUM_LAYERS,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
    topk_group=1, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=16, index_topk=TOPK, index_head_dim=32,
    index_n_heads=16, first_k_dense_replace=1, max_position_embeddings=512, bos_token_id=0, eos_token_id=1,
)
ARCHS = {
    "v32": ("DeepseekV32Config", dict(qk_nope_head_dim=24, v_head_dim=32), 11),
    "glm": ("GlmMoeDsaConfig", dict(qk_nope_head_dim=40, v_head_dim=48, indexer_types=GLM_INDEXER_TYPES), 12),
}


def dsa_config(arch: str, **overrides):
    name, extra, _ = ARCHS[arch]
    return getattr(transformers, name)(**(COMMON | extra | overrides))


def with_mtp_layer(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` with the multi-token-prediction layer the releases store after the last decoder layer, as
    model.layers.{NUM_LAYERS}.*: a DSA decoder layer (the last layer's weights; layer 0's indexer where the last
    is a shared layer without one) and the MTP head (embed_tokens, enorm, hnorm, eh_proj, shared_head). Loading
    skips all of it."""
    last, mtp, first = f"model.layers.{NUM_LAYERS - 1}.", f"model.layers.{NUM_LAYERS}.", "model.layers.0."
    layer = {mtp + n.removeprefix(last): t for n, t in tensors.items() if n.startswith(last)}
    for name, t in tensors.items():
        if name.startswith(first + "self_attn.indexer."):
            layer.setdefault(mtp + name.removeprefix(first), t)
    norm, hidden = tensors["model.norm.weight"], tensors["model.norm.weight"].shape[0]
    gen = torch.Generator().manual_seed(0)
    head = {"embed_tokens.weight": tensors["model.embed_tokens.weight"], "enorm.weight": norm, "hnorm.weight": norm,
            "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=gen) * 0.15,
            "shared_head.norm.weight": norm, "shared_head.head.weight": tensors["lm_head.weight"]}
    layer |= {mtp + n: t for n, t in head.items()}
    assert any(".self_attn.indexer.wq_b." in n for n in layer) and any(".mlp.experts." in n for n in layer)
    return tensors | {n: t.clone() for n, t in layer.items()}  # clones: safetensors refuses shared storage


@pytest.fixture(scope="module", params=list(ARCHS))
def dsa(request, tmp_path_factory):
    """The checkpoint as transformers saves it plus the MTP layer the releases carry (`with_mtp_layer`)."""
    arch = request.param
    model = build_model(dsa_config(arch), seed=ARCHS[arch][2])
    path = tmp_path_factory.mktemp(arch)
    model.save_pretrained(path)
    file = path / "model.safetensors"
    save_file(with_mtp_layer(load_file(str(file))), str(file), metadata={"format": "pt"})
    llm = LLM(path, dtype="float32", expert_placement="device", max_model_len=MAX_MODEL_LEN, max_num_seqs=4)
    return arch, path, model, llm


class _MarginRecorder:
    """Stands in for an indexer's backend: runs it, then records the row's gap between the k-th and (k+1)-th best
    reference score over its largest |score| (rows with more than k visible tokens)."""

    def __init__(self, backend, margins: list[float]):
        self.backend, self.margins = backend, margins

    def dsa_select(self, q, k, weights, index_cache, batch, scale, topk):
        selected = self.backend.dsa_select(q, k, weights, index_cache, batch, scale, topk)
        row_seq, row_limit = batch.token_rows()
        scores = dsa_reference.index_scores(q, weights, index_cache, batch.block_tables, row_seq, row_limit, scale,
                                            max(batch.seq_lens_cpu))
        for row, limit in zip(scores, row_limit.tolist(), strict=True):
            if limit > topk:
                best = row[:limit].topk(topk + 1).values
                self.margins.append(float((best[-2] - best[-1]) / best.abs().max()))
        return selected


@contextlib.contextmanager
def selection_margins(llm):
    margins: list[float] = []
    indexers = [m for m in llm.model.modules() if type(m).__name__ == "Indexer"]
    saved = [m.backend for m in indexers]
    for indexer in indexers:
        indexer.backend = _MarginRecorder(indexer.backend, margins)
    try:
        yield margins
    finally:
        for indexer, backend in zip(indexers, saved, strict=True):
            indexer.backend = backend


def test_checkpoint_is_the_released_layout(dsa):
    arch, path, _, llm = dsa
    from safetensors.torch import load_file

    names = set(load_file(str(path / "model.safetensors")))
    for part in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight"):
        assert f"model.layers.0.self_attn.indexer.{part}" in names
    assert ("model.layers.1.self_attn.indexer.wk.weight" in names) == (arch == "v32")  # GLM: layer 1 is shared
    # the MTP layer (skipped): a DSA layer, its indexer and routed experts included, and the MTP head
    for part in ("self_attn.indexer.wq_b.weight", "self_attn.indexer.weights_proj.weight", "self_attn.kv_b_proj.weight",
                 "mlp.experts.0.gate_proj.weight", "mlp.gate.e_score_correction_bias", "eh_proj.weight",
                 "shared_head.head.weight"):
        assert f"model.layers.{NUM_LAYERS}.{part}" in names
    assert len(llm.model.model.layers) == NUM_LAYERS
    specs = llm.config.layers
    expected = GLM_INDEXER_TYPES if arch == "glm" else ["full"] * 4
    assert ["shared" if s.attention.indexer.is_shared else "full" for s in specs] == expected
    assert {(s.attention.indexer.topk, s.attention.indexer.num_heads, s.attention.indexer.head_dim,
             s.attention.indexer.is_rope_interleaved) for s in specs} == {(TOPK, 16, 32, arch == "glm")}
    # a full layer caches its index key beside the latent (one cache group); a shared one has no index cache
    shapes = [layer.self_attn.kv_cache_shapes() for layer in llm.model.model.layers]
    latent = (1, 32 + 16)
    assert shapes == [(latent, (1, 32)) if t == "full" else (latent,) for t in expected]


@pytest.mark.parametrize("length", PROMPT_LENS)
def test_prefill_logits_match_transformers(dsa, length):
    arch, _, ref, llm = dsa
    ids = prompt(length, seed=400 + length)
    with selection_margins(llm) as margins:
        ours = llm.prefill_logits(ids)
    assert_logits_close(ours, hf_logits(ref, ids), f"{arch} prefill of {length}")
    assert min(margins, default=1.0) > 1e-5, f"{arch}: a top-k tie at the boundary; pick another seed"
    assert bool(margins) == (length > TOPK)


def test_greedy_generation_matches_transformers(dsa):
    arch, _, ref, llm = dsa
    ids = prompt(20, seed=101)
    expected = hf_generate(ref, ids, NUM_GREEDY)
    with selection_margins(llm) as margins:
        ours = llm.generate(ids, max_new_tokens=NUM_GREEDY, ignore_eos=True)
    assert_same_tokens(ours, expected, None, f"{arch} greedy")
    assert min(margins) > 1e-5


def test_the_selection_decides_the_output(dsa):
    """transformers' own logits change when index_topk covers the whole prompt, so the parity above checks the
    selection (and for GLM, that shared layers take the previous full layer's)."""
    arch, _, ref, _ = dsa
    ids = prompt(200, seed=600)
    sparse = hf_logits(ref, ids)
    for layer in ref.model.layers:
        if getattr(layer.self_attn, "indexer", None) is not None:
            layer.self_attn.indexer.index_topk = 1000
    try:
        dense = hf_logits(ref, ids)
    finally:
        for layer in ref.model.layers:
            if getattr(layer.self_attn, "indexer", None) is not None:
                layer.self_attn.indexer.index_topk = TOPK
    assert (sparse - dense).abs().max() > 1e-2 * sparse.abs().max()


@pytest.fixture(scope="module")
def dsa_kernels(dsa):
    from gpu_support import DEVICE

    arch, path, ref, _ = dsa
    llm = LLM(path, device=str(DEVICE), dtype="float32", kernels="triton", expert_placement="device",
              max_model_len=MAX_MODEL_LEN, max_num_seqs=4)
    return arch, ref.to(DEVICE), llm


def test_kernel_path_matches_transformers(dsa_kernels):
    """`kernels="triton"` (under the interpreter without a GPU): the index-score and top-k kernels
    (`gpu_layers.dsa`) and the sparse MLA kernel (`gpu_layers.mla_sparse`) for prefill and decode, then chunked
    prefill across the top-k boundary.

    Interpreted kernels cost seconds per token, so this checks the wiring at the fewest tokens that cross every
    boundary the layer sees: a one-token prefill (a decode-shaped step, which always selects, over a context
    shorter than top-k), a dense prefill (7, below top-k), a selecting one over three pages (33), decode past top-k
    into a third page (20 + 14 tokens: the last step writes position 32), and chunked prefill. Long
    contexts (several key tiles, 200 tokens) are the kernels' own tests (`test_gpu_dsa`) and the CPU path's
    parity above."""
    arch, ref, llm = dsa_kernels
    assert llm.backends.attention.name == "triton"
    for length in (1, 7, 33):
        ids = prompt(length, seed=400 + length)
        assert_logits_close(llm.prefill_logits(ids), hf_logits(ref, ids), f"{arch} kernels prefill of {length}")
    ids = prompt(20, seed=101)  # the CPU greedy test's prompt (its selection margins are checked there)
    expected = hf_generate(ref, ids, NUM_KERNEL_GREEDY)
    assert_same_tokens(llm.generate(ids, max_new_tokens=NUM_KERNEL_GREEDY, ignore_eos=True), expected, None,
                       f"{arch} kernels greedy")
    engine = Engine(llm, max_num_batched_tokens=16, max_num_seqs=2)  # a 40-token prompt in three chunks
    try:
        ids = prompt(40, seed=140)
        assert engine.generate([ids], max_tokens=3, ignore_eos=True)[0] == hf_generate(ref, ids, 3)
    finally:
        engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graph_decode_equals_eager(dsa):
    """Decode replayed as CUDA graphs (which always select: the graph is captured at max_model_len) gives the eager
    engine's tokens over 100 steps, batched, contexts below and above top-k."""
    _, path, _, _ = dsa
    prompts = [prompt(n, seed=90 + n) for n in (3, 9, 21, 40)]
    outputs = {}
    for is_graph in (False, True):
        llm = LLM(path, device="cuda", dtype="bfloat16", kernels="triton", expert_placement="device",
                  max_model_len=MAX_MODEL_LEN, max_num_seqs=4, cuda_graph=is_graph)
        engine = Engine(llm, max_num_batched_tokens=64, max_num_seqs=4)
        try:
            outputs[is_graph] = engine.generate(prompts, max_tokens=100, ignore_eos=True)
            assert (engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0) == is_graph
        finally:
            engine.close()
    assert outputs[True] == outputs[False]


# --- the engine: the index-key cache in the layer's pages --------------------------------------------------------


def _solo(llm, prompts, max_tokens):
    engine = Engine(llm, max_num_batched_tokens=llm.max_model_len, max_num_seqs=1)
    try:
        return [engine.generate([p], max_tokens=max_tokens, ignore_eos=True)[0] for p in prompts]
    finally:
        engine.close()


def test_batched_chunked_prefill_gives_solo_tokens(dsa):
    _, _, _, llm = dsa
    prompts = [prompt(n, seed=n) for n in (5, 60, 130, 17)]
    solo = _solo(llm, prompts, 10)
    engine = Engine(llm, max_num_batched_tokens=48, max_num_seqs=4)  # the 130-token prompt takes three chunks
    try:
        assert engine.generate(prompts, max_tokens=10, ignore_eos=True) == solo
    finally:
        engine.close()


def test_prefix_cache_hit_gives_solo_tokens(dsa):
    _, path, _, llm = dsa
    conversation = prompt(90, seed=77)
    resent = conversation[:64] + prompt(20, seed=78)
    uncached = LLM(path, dtype="float32", expert_placement="device", max_model_len=MAX_MODEL_LEN,
                   enable_prefix_caching=False)
    solo = _solo(uncached, [resent], 8)
    engine = Engine(llm)
    try:
        engine.generate([conversation], max_tokens=4, ignore_eos=True)
        request_id = engine.add_request(resent, max_tokens=8, ignore_eos=True)
        while engine.has_work():
            engine.step()
        request = engine.requests[request_id]
        assert request.num_cached == 64  # four full pages, index keys included, were not recomputed
        assert request.output_ids == solo[0]
    finally:
        engine.close()


def test_preemption_recomputes_the_same_tokens(dsa):
    """The engine's scores differ from the solo run's by float32 rounding (chunked prefill and batched decode sum
    in other orders: up to 2.1e-6 of the row's largest |score| measured on v32), which flips a selection wherever
    the k-th and (k+1)-th scores are closer than that. Prompt seed 2 had such a row (v32, layer 1, position 110:
    a gap of 1.8e-7 of max |score|) and gave other tokens from there on, before any preemption. The seeds are
    ones where every selection of the solo runs has a gap above 1e-5 of max |score|: each score would have to
    move 5e-6, over twice the rounding seen."""
    _, path, _, _ = dsa
    # 16 pages of 16 tokens: two 100-token prompts start (7 pages each) and outgrow them (9 each at 130 tokens)
    llm = LLM(path, dtype="float32", expert_placement="device", max_model_len=256, max_num_seqs=3,
              kv_cache_tokens=256)
    prompts = [prompt(100, seed=s) for s in (1, 4, 3)]
    with selection_margins(llm) as margins:
        solo = _solo(llm, prompts, 30)
    assert min(margins) > 1e-5, "a top-k near-tie in the solo runs; pick another seed"
    engine = Engine(llm, max_num_batched_tokens=48, max_num_seqs=3)
    preempted = []
    preempt = engine.scheduler.preempt
    engine.scheduler.preempt = lambda r: (preempted.append(r.request_id), preempt(r))
    try:
        assert engine.generate(prompts, max_tokens=30, ignore_eos=True) == solo
        assert preempted
    finally:
        engine.close()


# --- the checkpoint's extra tensors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dsa", ["glm"], indirect=True)
def test_glm_shared_layer_indexer_weights_are_skipped(dsa, tmp_path):
    """GLM-5.2's release ships no indexer weights on its shared layers, but a checkpoint derived from it may carry
    them on every layer (GGUF conversions of GLM-5.2 do): loading skips them (the model's `is_ignored_tensor`), the
    shared layers still take the previous full layer's selection and the logits are the release's. The stray
    weights are the previous full layer's, perturbed, so a shared layer that ran them would select otherwise."""
    _, path, ref, llm = dsa
    for file in path.iterdir():
        shutil.copy(file, tmp_path / file.name)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    for layer, kind in enumerate(GLM_INDEXER_TYPES):
        if kind == "shared":
            full = f"model.layers.{layer - 1}.self_attn.indexer."
            tensors |= {f"model.layers.{layer}.self_attn.indexer.{n.removeprefix(full)}":
                        t + 0.1 * torch.randn(t.shape, generator=gen) for n, t in tensors.items() if n.startswith(full)}
    assert "model.layers.3.self_attn.indexer.wq_b.weight" in tensors
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    stray = LLM(tmp_path, dtype="float32", expert_placement="device", max_model_len=MAX_MODEL_LEN)
    assert not any(hasattr(layer.self_attn, "indexer") for layer in stray.model.model.layers[1::2])
    ids = prompt(33, seed=433)  # the prefill test's 33-token prompt (its selection margins are checked there)
    got = stray.prefill_logits(ids)
    assert torch.equal(got, llm.prefill_logits(ids))
    assert_logits_close(got, hf_logits(ref, ids), "glm with indexer weights on its shared layers")


# --- the config ---------------------------------------------------------------------------------------------------


def _write_config(path, arch: str, update: dict, remove: tuple[str, ...] = ()) -> None:
    config = dsa_config(arch).to_dict() | {"architectures": [ARCHS[arch][0].replace("Config", "ForCausalLM")]}
    for key in remove:
        config.pop(key, None)
    (path / "config.json").write_text(json.dumps(config | update))


def test_glm52_schedule_spelling_gives_transformers_indexer_types(tmp_path):
    """GLM-5.2's config spells the schedule as index_topk_freq / index_skip_topk_offset; the layers we build are
    the ones transformers derives from it."""
    schedule = dict(num_hidden_layers=12, index_topk_freq=4, index_skip_topk_offset=3)
    _write_config(tmp_path, "glm", schedule, remove=("indexer_types", "mlp_layer_types", "layer_types"))
    _, config = load_model_config(tmp_path)
    want = transformers.GlmMoeDsaConfig(**(COMMON | schedule | {"indexer_types": None})).indexer_types
    assert "shared" in want
    assert ["shared" if s.attention.indexer.is_shared else "full" for s in config.layers] == want


@pytest.mark.parametrize("update, message", [
    ({"indexer_types": ["shared", "full", "full", "full"]}, "starts with a 'shared' layer"),
    ({"indexer_types": ["full", "sparse", "full", "full"]}, "'indexer_types' must list"),
    ({"q_lora_rank": None}, "q_lora_rank is null"),
    ({"index_head_dim": 8}, "index_head_dim 8 is smaller than qk_rope_head_dim 16"),
])
def test_config_errors_name_the_key(tmp_path, update, message):
    _write_config(tmp_path, "glm", update)
    with pytest.raises(ConfigError, match=message):
        load_model_config(tmp_path)


# --- FP8 (the released checkpoints' format) -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dsa_fp8(tmp_path_factory):
    """arch -> its FP8 block release (built once): `build_fp8_checkpoint`'s dict over the checkpoint with its MTP
    layer (in FP8 like the other layers), whose 'llm' runs the routed experts on the CPU operator as stored (FP8,
    the native kernels); 'device_llm' runs them dequantized on the engine's device; 'rounded_ref' is the reference
    with each expert matmul's input rounded to bfloat16 (the CPU FP8 kernels' contract)."""
    cache: dict[str, dict] = {}

    def get(arch: str) -> dict:
        if arch not in cache:
            built = build_fp8_checkpoint(dsa_config(arch), ARCHS[arch][2], tmp_path_factory, f"{arch}_fp8",
                                         publish=with_mtp_layer, expert_placement="cpu")
            built["device_llm"] = LLM(built["path"], dtype="float32", expert_placement="device")
            built["rounded_ref"] = round_expert_inputs(copy.deepcopy(built["ref"]))
            cache[arch] = built
        return cache[arch]

    yield get
    for built in cache.values():  # the CPU operator's worker threads
        built["llm"].close()
        built["device_llm"].close()


def cpu_expert_dtypes(llm) -> list[str]:
    return [m.op.spec.dtype for m in llm.model.modules() if isinstance(m, CpuExperts)]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_fp8_release_matches_the_dequantized_reference(dsa_fp8, arch):
    """FP8 block-scaled projections, the indexer's wq_b and wk included (its weights_proj stays 16-bit, as
    released), and the MTP layer stored in FP8 too. The experts on the device (dequantized at load) match the
    dequantized reference to float32 rounding; on the CPU operator, FP8 as stored, they match it with each expert
    matmul's input rounded to bfloat16 (`test_direct_serving.FLOAT_FORMAT_TOL` says why that allows ~1e-3)."""
    built = dsa_fp8(arch)
    stored, mtp = built["stored"], f"model.layers.{NUM_LAYERS}"
    for name in ("model.layers.1.self_attn.indexer.wq_b.weight" if arch == "v32" else
                 "model.layers.2.self_attn.indexer.wq_b.weight", "model.layers.1.mlp.experts.3.down_proj.weight",
                 f"{mtp}.self_attn.indexer.wk.weight", f"{mtp}.mlp.experts.0.gate_proj.weight"):
        assert stored[name].dtype == torch.float8_e4m3fn and name + "_scale_inv" in stored, name
    assert stored["model.layers.0.self_attn.indexer.weights_proj.weight"].dtype == torch.float32
    assert cpu_expert_dtypes(built["llm"]) == ["fp8"] * (NUM_LAYERS - COMMON["first_k_dense_replace"])
    assert cpu_expert_dtypes(built["device_llm"]) == []
    for length in (1, 7, 33):
        ids = prompt(length, seed=500 + length)
        want = hf_logits(built["ref"], ids)
        assert_logits_close(built["device_llm"].prefill_logits(ids), want, f"{arch} FP8, experts on the device")
        with selection_margins(built["llm"]) as margins:
            got = built["llm"].prefill_logits(ids)
        want = hf_logits(built["rounded_ref"], ids)
        err, scale = float((got - want).abs().max()), float(want.abs().max())
        assert err <= FLOAT_FORMAT_TOL * scale, f"{arch} FP8 CPU experts, prefill of {length}: {err:.3e} / {scale:.3e}"
        assert min(margins, default=1.0) > 1e-5, f"{arch}: a top-k tie at the boundary; pick another seed"


def test_fp8_release_converted_gives_the_direct_logits(dsa_fp8, tmp_path):
    """`hybrid-convert` of the GLM FP8 release (GLM-5.2's shared indexer layers, the MTP layer skipped): the
    converted directory keeps the experts' FP8 as stored and computes the direct load's logits exactly."""
    built = dsa_fp8("glm")
    dst = tmp_path / "converted"
    assert convert_main([str(built["path"]), str(dst), "--threads", "2"]) == 0
    moe_layers = range(COMMON["first_k_dense_replace"], NUM_LAYERS)  # the MTP layer's experts are not converted
    assert sorted(p.name for p in (dst / "experts").iterdir()) == [f"layer-{i:03d}.safetensors" for i in moe_layers]
    converted = LLM(dst, dtype="float32")
    try:
        assert cpu_expert_dtypes(converted) == cpu_expert_dtypes(built["llm"])
        for length in (1, 33):
            ids = prompt(length, seed=500 + length)
            is_equal = torch.equal(converted.prefill_logits(ids), built["llm"].prefill_logits(ids))
            assert is_equal, f"glm FP8 converted: prefill of {length} differs from the direct load"
    finally:
        converted.close()
