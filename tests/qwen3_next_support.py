"""Tiny Qwen3-Next, Qwen3.5-MoE and dense Qwen3.5 checkpoints written by transformers (the Qwen3.5 ones through
their multimodal wrappers, with a tiny vision tower), and the CPU engine options their tests share."""

from __future__ import annotations

import torch

from hybrid.engine import Engine
from hybrid.llm import LLM

NUM_LAYERS = 4  # layers 0-2 Gated DeltaNet, layer 3 full attention
TEXT = dict(vocab_size=128, hidden_size=64, num_hidden_layers=NUM_LAYERS, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=8, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
MAX_MODEL_LEN = 256
CHUNK = 48  # max_num_batched_tokens of the chunked engines: a 200-token prompt takes five chunks
PROMPT_LENS = (1, 7, 33, 200)
NUM_GREEDY = 32


def perturbed(model):
    """transformers initialises the norms to 0 (or 1) and the DeltaNet's A_log/dt_bias to fixed ranges: noise on
    every parameter makes (1 + w) against w, and every other weight, visible."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    return model.eval()


def write_qwen3_next(transformers, path, **dims):
    """Saves a perturbed random Qwen3NextForCausalLM (TEXT, with `dims` changed) under `path`; returns it."""
    torch.manual_seed(0)
    config = transformers.Qwen3NextConfig(**(TEXT | dims), intermediate_size=96)
    model = perturbed(transformers.Qwen3NextForCausalLM(config))
    model.save_pretrained(path)
    return model


def write_qwen3_5(transformers, path, is_released: bool = True, **dims):
    """Saves a perturbed random Qwen3.5-MoE (TEXT with `dims` changed) under `path`: as released
    (Qwen3_5MoeForConditionalGeneration, VISION) or text only (Qwen3_5MoeForCausalLM); returns it."""
    torch.manual_seed(0)
    if is_released:
        config = transformers.Qwen3_5MoeConfig(text_config=TEXT | dims, vision_config=VISION)
        model = perturbed(transformers.Qwen3_5MoeForConditionalGeneration(config))
    else:
        model = perturbed(transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**(TEXT | dims))))
    model.save_pretrained(path)
    return model


def dense_text(**dims) -> dict:
    """TEXT as the dense Qwen3.5 has it: no experts, one gated MLP of `intermediate_size` per layer."""
    moe_keys = ("moe_intermediate_size", "shared_expert_intermediate_size", "num_experts", "num_experts_per_tok")
    return {k: v for k, v in TEXT.items() if k not in moe_keys} | {"intermediate_size": 96} | dims


def write_qwen3_5_dense(transformers, path, is_released: bool = True, **dims):
    """Saves a perturbed random dense Qwen3.5 under `path`: as released (Qwen3_5ForConditionalGeneration, VISION, text
    weights under `model.language_model.*`) or text only (Qwen3_5ForCausalLM); returns it."""
    torch.manual_seed(0)
    if is_released:
        config = transformers.Qwen3_5Config(text_config=dense_text(**dims), vision_config=VISION)
        model = perturbed(transformers.Qwen3_5ForConditionalGeneration(config))
    else:
        model = perturbed(transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**dense_text(**dims))))
    model.save_pretrained(path)
    return model


def make_llm(path, **options) -> LLM:
    options = {"device": "cpu", "dtype": "float32", "expert_placement": "device", "max_model_len": MAX_MODEL_LEN,
               "max_num_seqs": 4} | options
    return LLM(path, **options)


def random_prompt(length: int, seed: int = 0) -> list[int]:
    return torch.randint(0, TEXT["vocab_size"], (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy_matches_reference(model, prompt: list[int], tokens: list[int]) -> bool:
    """Whether `tokens` are transformers' greedy continuation of `prompt`: one uncached forward over prompt + tokens,
    each token the argmax after the ones before it (by induction, the tokens its own greedy loop would pick)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    return logits.argmax(-1).tolist() == tokens


def check_parity(model, llm, name: str, lengths=PROMPT_LENS) -> None:
    """Float32 prefill logits of a prompt of each length within 1e-4 of the largest |logit| of transformers' `model`,
    then NUM_GREEDY greedy tokens per prompt as transformers picks them, from one engine that batches the prompts
    (in CHUNK-token chunks, the recurrent states carried over)."""
    prompts = [random_prompt(length, seed=length) for length in lengths]
    for prompt in prompts:
        with torch.no_grad():
            ref = model(torch.tensor([prompt])).logits[0].float()
        ours = llm.prefill_logits(prompt)
        assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max(), f"{name}: prefill of {len(prompt)} tokens"
    engine = Engine(llm, max_num_batched_tokens=CHUNK, max_num_seqs=len(prompts))
    try:
        outputs = engine.generate(prompts, max_tokens=NUM_GREEDY, ignore_eos=True)
    finally:
        engine.close()
    for prompt, tokens in zip(prompts, outputs, strict=True):
        assert len(tokens) == NUM_GREEDY and greedy_matches_reference(model, prompt, tokens), \
            f"{name}: greedy after a prompt of {len(prompt)} tokens"


def solo_tokens(llm, prompts, max_tokens) -> list[list[int]]:
    """Each prompt's greedy tokens from an engine that runs it alone, in one prefill step."""
    engine = Engine(llm, max_num_batched_tokens=MAX_MODEL_LEN, max_num_seqs=1)
    try:
        return [engine.generate([p], max_tokens=max_tokens, ignore_eos=True)[0] for p in prompts]
    finally:
        engine.close()


def run_together(engine, prompts, max_tokens, on_step=None) -> list[list[int]]:
    """The prompts added to `engine` at once and stepped to the end (`on_step(engine)` after each step); their
    tokens, in order."""
    ids = [engine.add_request(p, max_tokens=max_tokens, ignore_eos=True) for p in prompts]
    for _ in range(2000):
        if not engine.has_work():
            break
        engine.step()
        if on_step is not None:
            on_step(engine)
    return [engine.requests.pop(i).output_ids for i in ids]
