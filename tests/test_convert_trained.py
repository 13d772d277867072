"""Quantized experts against the issue's accuracy targets, on tiny models that were trained.

Random-weight models are a poor judge of quantization damage: their next-token distributions are flat, so the
top-2 logits of a few percent of positions are within any perturbation of each other and top-1 agreement
measures ties, not the quantizer. Real models are confident. So each model here is first trained for a hundred
steps on a synthetic second-order Markov language (the next token is a fixed function of the previous two, 90% of
the time), which gives it confident predictions that depend on attention and the MoE layers. Then: int8 experts
(per channel) keep mean KL per position < 1e-3 and top-1 agreement >= 99% against the float32 model; int4
(group 128) keeps KL < 2e-2, both with the default int8 activations (W8A8) and with float activations; and with
float activations, int4 costs measurably more than int8 (so the bounds measure the quantizer).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from checkpoints import VARIANTS

from convert.cli import main
from hybrid import LLM

transformers.logging.set_verbosity_error()
VOCAB = 256
FIRST_TOKEN = 3  # ids below are bos/eos/pad
CONTEXTS = 4  # the previous-but-one token enters through its residue mod 4: 4 x 256 transitions, all well learned
NOISE = 0.1
STEPS, BATCH, LENGTH = 100, 16, 64


def markov_batch(rule: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    seq = list(torch.randint(FIRST_TOKEN, VOCAB, (2, n), generator=gen))
    for _ in range(2, length):
        follow = rule[seq[-2] % CONTEXTS, seq[-1]]
        noise = torch.randint(FIRST_TOKEN, VOCAB, (n,), generator=gen)
        seq.append(torch.where(torch.rand(n, generator=gen) < NOISE, noise, follow))
    return torch.stack(seq, 1)  # [n, length]


def train(variant: str, path, seed: int = 0) -> tuple[torch.nn.Module, torch.Tensor]:
    """Trains the variant's tiny model, saves it in bfloat16 to `path`; returns the float32 model holding exactly
    the saved weights, and held-out sequences."""
    gen = torch.Generator().manual_seed(seed)
    rule = torch.randint(FIRST_TOKEN, VOCAB, (CONTEXTS, VOCAB), generator=gen)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(VARIANTS[variant](), attn_implementation="eager",
                                                          dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(STEPS):
        ids = markov_batch(rule, BATCH, LENGTH, gen)
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).float())  # the reference holds exactly the stored values
    model.to(torch.bfloat16).save_pretrained(path)
    model.float()
    return model, markov_batch(rule, 8, LENGTH, torch.Generator().manual_seed(99))


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def trained(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"trained_{request.param}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the same trained model on every machine and in every test order
    try:
        model, heldout = train(request.param, path)
    finally:
        torch.set_num_threads(threads)
    with torch.no_grad():
        ref = [model(ids[None]).logits[0].float() for ids in heldout]
    return request.param, path, heldout, ref


def kl_and_top1(ref: list[torch.Tensor], ours: list[torch.Tensor]) -> tuple[float, float]:
    ref_logp = torch.cat(ref).log_softmax(-1)
    our_logp = torch.cat(ours).log_softmax(-1)
    kl = (ref_logp.exp() * (ref_logp - our_logp)).sum(-1)
    return float(kl.mean()), float((ref_logp.argmax(-1) == our_logp.argmax(-1)).float().mean())


def test_trained_models_are_confident(trained):
    """The premise: the trained model predicts the rule (its top-1 is the rule's token most of the time)."""
    _, _, heldout, ref = trained
    correct = [(logits[1:-1].argmax(-1) == ids[2:]).float().mean() for ids, logits in zip(heldout, ref, strict=True)]
    accuracy = float(torch.stack(correct).mean())
    print(f"{trained[0]}: top-1 is the rule's token at {accuracy:.3f} of positions")
    assert accuracy > 0.6


def test_int8_and_int4_meet_the_accuracy_targets(trained, tmp_path):
    variant, src, heldout, ref = trained
    results = {}
    for dtype in ("int8", "int4"):
        dst = tmp_path / dtype
        assert main([str(src), str(dst), "--expert-dtype", dtype]) == 0
        for activations in ("int8", "float"):
            llm = LLM(dst, dtype="float32", expert_activations=activations)
            kl, top1 = results[dtype, activations] = kl_and_top1(ref, [llm.prefill_logits(ids.tolist())
                                                                        for ids in heldout])
            print(f"{variant} {dtype} experts, {activations} activations: mean KL {kl:.2e}, top-1 {top1:.4f}")
    for activations in ("int8", "float"):
        (kl8, top8), (kl4, _) = results["int8", activations], results["int4", activations]
        assert 0 < kl8 < 1e-3 and top8 >= 0.99
        assert kl4 < 2e-2
    # the metric sees the quantizer: int4 costs several times int8's KL (34x for qwen3_moe, 28x for deepseek_v3 with
    # transformers 5.17 and torch 2.13; the trained model, and so the ratio, moves with their versions)
    assert results["int4", "float"][0] > 3 * results["int8", "float"][0]
