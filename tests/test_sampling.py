"""`sample_batch` against the one-row references `sample` and `apply_penalties`: the same tokens for greedy rows,
the same penalised logits, the same distributions after top-k/top-p/min-p, seeded rows that do not depend on their
batch, logprobs of the penalised logits, and one device-to-host transfer per call."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybrid.sampling import (
    RowInputs,
    SamplingParams,
    TokenMask,
    apply_penalties,
    apply_penalties_batch,
    sample,
    sample_batch,
)

# Probabilities chosen so each filter's cutoff lands next to a token with a large share: an off-by-one in any cutoff
# moves a lot of mass. Sorted: 0.30 0.22 0.16 0.12 0.08 0.05 0.03 0.02 0.01 0.01; shuffled so order matters.
PROBS = torch.tensor([0.05, 0.30, 0.01, 0.12, 0.22, 0.02, 0.08, 0.16, 0.01, 0.03])
LOGITS = PROBS.log() + 1.5  # softmax gives PROBS back; the offset keeps the logits from being normalised

FILTERS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=2.0, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.6),  # 0.30 + 0.22 < 0.6: the 0.16 token is the last one kept
    SamplingParams(temperature=0.8, top_p=0.8, top_k=5),
    SamplingParams(temperature=1.0, min_p=0.3),  # 0.3 * 0.30 = 0.09: the 0.12 token stays, the 0.08 one goes
    SamplingParams(temperature=1.0, min_p=0.2, top_p=0.7),
    SamplingParams(temperature=1.0, repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=-0.3),
]
PROMPT_IDS, OUTPUT_IDS = [1, 4, 4], [7, 3, 7, 0]


def reference_probs(params: SamplingParams, monkeypatch) -> torch.Tensor:
    """The normalised distribution `sample` hands to torch.multinomial for LOGITS (penalised like the batch)."""
    seen = []
    multinomial = torch.multinomial
    monkeypatch.setattr(torch, "multinomial", lambda probs, *a, **k: seen.append(probs) or multinomial(probs, *a, **k))
    logits = apply_penalties(LOGITS, PROMPT_IDS, OUTPUT_IDS, params) if params.has_penalties else LOGITS
    sample(logits[None], params, None)
    monkeypatch.undo()
    return seen[0][0] / seen[0][0].sum()


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    rows = [RowInputs(SamplingParams(logprobs=2 if i % 2 else None)) for i in range(6)]
    assert sample_batch(logits, rows).token_ids == logits.argmax(dim=-1).tolist()
    assert sample_batch(logits[:0], []).token_ids == []


def test_penalties_match_apply_penalties_row_by_row():
    logits = torch.randn(7, 40, generator=torch.Generator().manual_seed(1)) * 3  # about half negative
    cases = [
        (SamplingParams(repetition_penalty=1.3), [5, 5, 9], []),  # empty output, a repeated prompt token
        (SamplingParams(frequency_penalty=0.7, presence_penalty=0.2), [1], [3, 3, 3, 8]),
        (SamplingParams(repetition_penalty=0.6, frequency_penalty=-1.1, presence_penalty=1.9), [2, 8, 30], [8, 8, 39]),
        (SamplingParams(), [4, 5], [6]),  # no penalties: untouched
        (SamplingParams(presence_penalty=2.0), [0], []),  # presence with nothing generated: untouched
        (SamplingParams(repetition_penalty=2.0, presence_penalty=0.5), [], [0, 1, 2, 2, 39]),
        (SamplingParams(temperature=0.9, frequency_penalty=0.3), [7], [7, 7, 12]),
    ]
    rows = [RowInputs(p, None, prompt, output) for p, prompt, output in cases]
    got = apply_penalties_batch(logits, rows)
    for i, (params, prompt, output) in enumerate(cases):
        assert torch.equal(got[i], apply_penalties(logits[i], prompt, output, params)), i
    greedy = [RowInputs(SamplingParams(**{**p.__dict__, "temperature": 0.0}), None, a, b) for p, a, b in cases]
    assert sample_batch(logits, greedy).token_ids == got.argmax(dim=-1).tolist()
    plain = [RowInputs(SamplingParams()) for _ in cases]
    assert apply_penalties_batch(logits, plain) is logits  # nothing to do: no copy


def test_filters_match_the_reference_distribution(monkeypatch):
    """Every parameter set of FILTERS in one batch of 8 x 6000 rows: the tokens a filter drops never come out and
    the frequencies of the rest are those of `sample`'s distribution within 5 standard deviations."""
    num_draws = 6000
    rows = [RowInputs(p, None, PROMPT_IDS, OUTPUT_IDS) for p in FILTERS] * num_draws
    tokens = sample_batch(LOGITS.expand(len(rows), -1), rows, torch.Generator().manual_seed(2)).token_ids
    counts = torch.zeros(len(FILTERS), len(PROBS))
    counts.index_put_((torch.arange(len(rows)) % len(FILTERS), torch.tensor(tokens)), torch.ones(()), accumulate=True)
    for j, params in enumerate(FILTERS):
        want = reference_probs(params, monkeypatch)
        got = counts[j] / num_draws
        assert torch.all(got[want == 0] == 0), (params, got, want)
        sigma = (want * (1 - want) / num_draws).sqrt()
        assert torch.all((got - want).abs() <= 5 * sigma + 1e-3), (params, got, want)


def test_seeded_rows_do_not_depend_on_their_batch():
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11)

    def run(is_batched: bool, seed: int = 11) -> list[int]:
        generator, shared, tokens = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(0), []
        for step in range(6):
            row = RowInputs(params, generator, [1, 2], tokens)
            if not is_batched:
                tokens.append(sample_batch(logits[2:3], [row]).token_ids[0])
                continue
            others = [RowInputs(SamplingParams(temperature=1.0)), RowInputs(SamplingParams()),
                      RowInputs(SamplingParams(temperature=0.5, seed=5), torch.Generator().manual_seed(5 + step)),
                      RowInputs(SamplingParams(temperature=2.0, top_k=4, repetition_penalty=1.2), None, [7], [8])]
            tokens.append(sample_batch(logits, others[:2] + [row] + others[2:], shared).token_ids[2])
        return tokens

    alone = run(is_batched=False)
    assert run(is_batched=True) == alone == run(is_batched=False)
    assert any(run(is_batched=False, seed=s) != alone for s in (12, 13, 14))


def test_logprobs_are_the_penalised_distribution():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(4)) * 2
    cases = [
        (SamplingParams(logprobs=0), [1], [2]),
        (SamplingParams(temperature=0.6, top_k=3, logprobs=3, repetition_penalty=1.4), [1, 2], [5, 5]),
        (SamplingParams(), [0], []),
        (SamplingParams(temperature=1.0, logprobs=20, frequency_penalty=0.5), [3], [9, 9, 4]),
        (SamplingParams(logprobs=1, presence_penalty=-1.0), [3], [0]),
    ]
    rows = [RowInputs(p, torch.Generator().manual_seed(i), a, b) for i, (p, a, b) in enumerate(cases)]
    result = sample_batch(logits, rows)
    for i, (params, prompt, output) in enumerate(cases):
        if params.logprobs is None:
            assert result.logprobs[i] is None and result.top_logprobs[i] is None
            continue
        want = torch.log_softmax(apply_penalties(logits[i], prompt, output, params), dim=-1)
        assert result.logprobs[i] == pytest.approx(float(want[result.token_ids[i]]), abs=1e-6)
        top = want.topk(params.logprobs)
        assert [t for t, _ in result.top_logprobs[i]] == top.indices.tolist()
        assert [lp for _, lp in result.top_logprobs[i]] == pytest.approx(top.values.tolist(), abs=1e-6)
    assert result.top_logprobs[0] == ()
    assert sample_batch(logits[:1], [RowInputs(SamplingParams(logprobs=20))]).top_logprobs[0][-1][0] in range(30)
    for bad in (-1, 21):
        with pytest.raises(ValueError, match="logprobs must be None or in"):
            SamplingParams(logprobs=bad)


class _SyncingOps(TorchDispatchMode):
    """Records the aten ops that read a tensor's data back to the host (or wait for it to size an output)."""

    SYNCING = ("_local_scalar_dense", "nonzero", "masked_select", "equal", "is_nonzero", "unique", "item")

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(func.__name__.startswith(s) for s in self.SYNCING):
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("is_masked", [False, True], ids=["plain", "grammar_mask"])
def test_one_device_to_host_transfer_per_call(monkeypatch, is_masked):
    """Every feature at once: penalties, greedy, shared and seeded draws, top-k/top-p/min-p and top logprobs, and
    a grammar mask; the only way back to the host is the single packed `.tolist()`, and the way there never blocks
    (a blocking host-to-device copy waits for the CUDA stream too): tensors are built on the host and moved
    non_blocking."""
    calls = []
    for method in ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        original = getattr(torch.Tensor, method)
        monkeypatch.setattr(torch.Tensor, method,
                            lambda self, *a, _m=method, _f=original, **k: calls.append(_m) or _f(self, *a, **k))
    tensor, to = torch.tensor, torch.Tensor.to
    moves = []  # (a device was named, non_blocking) of each .to; torch.tensor(device=...) would block
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: calls.append("tensor(device)") if "device" in k
                        else tensor(*a, **k))
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: moves.append(
        (any(isinstance(x, (str, torch.device)) for x in (*a, k.get("device"))), k.get("non_blocking", False)))
        or to(self, *a, **k))
    rows = [RowInputs(p, torch.Generator().manual_seed(i) if i % 3 == 0 else None, PROMPT_IDS, OUTPUT_IDS)
            for i, p in enumerate(FILTERS + [SamplingParams(logprobs=0), SamplingParams(temperature=0.5, logprobs=5)])]
    logits = torch.randn(len(rows), 64)
    mask = TokenMask(torch.full((len(rows), 2), -1, dtype=torch.int32)) if is_masked else None
    with _SyncingOps() as ops:
        result = sample_batch(logits, rows, torch.Generator().manual_seed(0), mask=mask)
    assert calls == ["tolist"] and ops.seen == []
    assert (True, True) in moves and (True, False) not in moves
    assert len(result.token_ids) == len(rows) and math.isfinite(result.logprobs[-1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("is_masked", [False, True], ids=["plain", "grammar_mask"])
def test_one_stream_sync_on_cuda(is_masked):
    """On the GPU itself: CUDA's sync debug mode warns once per synchronising call, and a call makes one, with a
    grammar mask (in page-locked memory, as the engine fills it) too."""
    rows = [RowInputs(p, torch.Generator("cuda").manual_seed(i) if i % 3 == 0 else None, PROMPT_IDS, OUTPUT_IDS)
            for i, p in enumerate(FILTERS + [SamplingParams(logprobs=0), SamplingParams(temperature=0.5, logprobs=5)])]
    logits = torch.randn(len(rows), 64, device="cuda")
    mask = TokenMask(torch.full((len(rows), 2), -1, dtype=torch.int32, pin_memory=True)) if is_masked else None
    sample_batch(logits, rows, mask=mask)  # warm up: lazy initialisation may synchronise once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = sample_batch(logits, rows, mask=mask)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len([w for w in caught if "synchroniz" in str(w.message)]) == 1, [str(w.message) for w in caught]
    assert len(result.token_ids) == len(rows)


def test_rows_with_nan_or_inf_logits_fail_alone():
    """A row whose logits hold a NaN or an inf samples nothing (token -1 and an error), greedy or random, with or
    without logprobs; the other rows of the batch are sampled as usual. Today's argmax would return token 0."""
    logits = LOGITS.repeat(4, 1)
    logits[1, 3] = float("nan")
    logits[2, 5] = float("inf")
    rows = [RowInputs(SamplingParams()), RowInputs(SamplingParams(logprobs=2)),
            RowInputs(SamplingParams(temperature=0.8, seed=3)), RowInputs(SamplingParams(temperature=0.8, seed=3))]
    result = sample_batch(logits, rows)
    assert result.token_ids[0] == int(LOGITS.argmax()) and result.errors[0] is None
    assert result.token_ids[1:3] == [-1, -1] and all("NaN or inf" in e for e in result.errors[1:3])
    assert result.logprobs[1] is None and result.top_logprobs[1] is None
    assert result.token_ids[3] >= 0 and result.errors[3] is None


def test_tiny_temperatures_are_greedy():
    """Below 1e-5 the logits divided by the temperature overflow float32: such a request is greedy, as in vLLM."""
    logits = (LOGITS * 1e34)[None]
    for temperature in (1e-7, 9.9e-6):
        result = sample_batch(logits, [RowInputs(SamplingParams(temperature=temperature, seed=1))])
        assert result.token_ids == [int(LOGITS.argmax())] and result.errors == [None]
    assert not SamplingParams(temperature=1e-5).is_greedy


@pytest.mark.parametrize("name, value", [("repetition_penalty", 1e-50), ("repetition_penalty", 1e39),
                                         ("repetition_penalty", math.nan), ("presence_penalty", math.nan),
                                         ("frequency_penalty", math.inf), ("temperature", 1e39),
                                         ("temperature", math.nan), ("top_p", math.nan), ("min_p", math.nan)])
def test_knobs_that_are_not_finite_in_float32_are_refused(name, value):
    """1e-50 rounds to 0 in float32 (logits / 0), 1e39 to inf; NaN passes every range check by comparing false."""
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


def test_logit_bias_forces_bans_and_leaves_other_rows_alone():
    """+100 on a token forces it even for a random row, -100 bans the greedy choice, the batch's other rows keep
    their exact logits, and the batch equals the one-row reference (`apply_penalties` adds the bias last)."""
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2))
    top = int(logits[1].argmax())
    cases = [SamplingParams(temperature=1.0, seed=3, logit_bias=((17, 100.0),)),
             SamplingParams(logit_bias=((top, -100.0),)),
             SamplingParams(),
             SamplingParams(repetition_penalty=1.4, logit_bias=((2, 3.5), (9, -0.25)))]
    rows = [RowInputs(p, torch.Generator().manual_seed(i), [2, 9], [5]) for i, p in enumerate(cases)]
    result = sample_batch(logits, rows)
    assert result.token_ids[0] == 17 and result.token_ids[1] != top
    assert result.token_ids[2] == int(logits[2].argmax())
    from hybrid.sampling import apply_logit_bias_batch

    biased = apply_logit_bias_batch(apply_penalties_batch(logits, rows), rows)
    for i, params in enumerate(cases):
        assert torch.equal(biased[i], apply_penalties(logits[i], [2, 9], [5], params)), i
    assert apply_logit_bias_batch(logits, [RowInputs(SamplingParams())] * 4) is logits


@pytest.mark.parametrize("bias, message", [(((3, 100.5),), "in \\[-100, 100\\]"), (((-1, 1.0),), "token ids >= 0"),
                                           (tuple((t, 1.0) for t in range(301)), "at most 300")])
def test_logit_bias_is_checked(bias, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=bias)
