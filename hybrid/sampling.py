"""Token sampling from float32 logits: greedy, or temperature with top-k, top-p and min-p filtering; repetition
(HF's: seen tokens' logits divided, or multiplied when negative), presence and frequency (OpenAI's: subtracted per
generated token) penalties applied first, then OpenAI's logit_bias (added to its tokens' logits). A
grammar-constrained row (`GuidedSpec`, `hybrid.guided`) has its disallowed tokens at -inf before all of that.

`sample_batch` is what the engine runs: every row of a step at once on the logits' device, with one
device-to-host transfer for the tokens and their logprobs. `sample` and `apply_penalties` are the one-parameter-set
references it is tested against."""

from __future__ import annotations

import functools
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for one token's bias: +-100 forces or bans it
MAX_LOGIT_BIAS_TOKENS = 300  # OpenAI's limit on the tokens one request biases
# Temperatures below this are greedy (as in vLLM): dividing float32 logits by them overflows to inf.
GREEDY_TEMPERATURE = 1e-5
NON_FINITE_LOGITS = "the logits are NaN or inf (the model's output, or penalties applied to it)"


GUIDED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class GuidedSpec:
    """A grammar the output must follow, as data (compiled and cached by `hybrid.guided.GrammarCache`): `kind`
    one of GUIDED_KINDS, `spec` its text: a JSON schema, a regex, a JSON list of the choices, an EBNF grammar or
    a structural tag's JSON (json_object: none)."""

    kind: str
    spec: str = ""

    def __post_init__(self):
        if self.kind not in GUIDED_KINDS:
            raise ValueError(f"guided kind must be one of {', '.join(GUIDED_KINDS)}, got {self.kind!r}")


@dataclass(frozen=True)
class TokenMask:
    """The tokens each row of a step may sample: `bitmask` [N, ceil(V / 32)] int32 on the host, one row per sampled
    row, bit j of word w allowing token 32 * w + j (xgrammar's layout); an unconstrained row's words are all ones.
    On CUDA the engine fills it in page-locked memory, so that its one copy to the device does not wait for the
    step (`hybrid.guided.GuidedRequests.fill`)."""

    bitmask: torch.Tensor


def _float32(name: str, value: float) -> float:
    """`value` as the sampler computes with it: a float whose float32 rounding is finite."""
    rounded = array("f", [value])[0]  # overflows to inf, as torch's float32 does
    if not math.isfinite(value) or not math.isfinite(rounded):
        raise ValueError(f"{name} must be a finite float32 value, got {value}")
    return rounded


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: all tokens
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0  # 1: off; > 1 discourages tokens of the prompt and the output
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    logprobs: int | None = None  # None: none; 0: the sampled token's; k: also the k most likely tokens'
    # OpenAI's logit_bias: (token id, bias) pairs, each bias added to its token's logit after the penalties
    logit_bias: tuple[tuple[int, float], ...] = ()
    guided: GuidedSpec | None = None  # None: unconstrained

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            _float32(name, getattr(self, name))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if _float32("repetition_penalty", self.repetition_penalty) <= 0:  # 1e-50 is 0 in float32: logits / 0
            raise ValueError(f"repetition_penalty must be > 0 (in float32), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be None or in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"logit_bias may bias at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(self.logit_bias)}")
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {token!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token}")

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


@dataclass(frozen=True)
class RowInputs:
    """One row of `sample_batch`: its parameters, its own generator (a seeded request) or None (the batch's shared
    one), and the token ids its penalties look at."""

    params: SamplingParams
    generator: torch.Generator | None = None
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()


@dataclass(frozen=True)
class SampleResult:
    """Per row, on the host: the sampled token, its logprob, and its `params.logprobs` most likely tokens as
    (token id, logprob) pairs, most likely first (empty for logprobs=0; both None where logprobs is None). A row
    whose logits hold a NaN or inf has no token: its id is -1 and `errors` says why (None for the other rows)."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[tuple[tuple[int, float], ...] | None]
    errors: list[str | None]


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits [N, V] float32 -> token ids [N]."""
    if params.is_greedy:
        return logits.argmax(dim=-1)
    logits = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the tokens ranked above it already cover top_p; the first token always stays.
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs > params.top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def apply_penalties(logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int],
                    params: SamplingParams) -> torch.Tensor:
    """logits [V] float32 of one sequence -> penalised copy, its logit bias added last."""
    logits = logits.clone()
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=logits.device)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        ids = torch.tensor(output_ids, dtype=torch.long, device=logits.device)
        counts = torch.zeros_like(logits).index_add_(0, ids, torch.ones_like(ids, dtype=logits.dtype))
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    for token, bias in params.logit_bias:
        logits[token] += bias
    return logits


def sample_batch(logits: torch.Tensor, rows: Sequence[RowInputs], generator: torch.Generator | None = None,
                 mask: TokenMask | None = None) -> SampleResult:
    """logits [N, V] float32 on the device, one `RowInputs` per row -> the rows' tokens and logprobs on the host.

    Per row: penalties (`apply_penalties`), then argmax for a greedy row, or temperature, top-k, min-p and top-p
    (`sample`'s semantics) and a draw for a random one. A row with a generator draws its noise from it alone, so a
    seeded request gets the same tokens whatever it is batched with; the other random rows share `generator` (None:
    the device's default one).

    Logprobs are log_softmax of the penalised logits, before temperature and top-k/top-p/min-p: the distribution
    the model and the request's penalties put on the next token, whatever filter then picked it (vLLM's default
    returns the raw model's, before penalties; the two agree for a request without penalties).

    A row with a NaN or inf among its penalised logits samples nothing (token -1, an error): argmax would pick
    whatever the NaN is, and the request must fail rather than continue on a garbage token.

    `mask` (grammar-constrained rows, `TokenMask`): each row's disallowed tokens are -inf first, before the
    penalties, so they are never sampled and the logprobs are the constrained distribution's; those -inf are not
    errors. Without a mask nothing of this runs.

    Everything stays on the device up to one `.tolist()` of a packed float64 tensor (token ids are exact in it), so
    a CUDA step waits for the GPU once."""
    if not rows:
        return SampleResult([], [], [], [])
    logits, disallowed = apply_token_mask(logits, mask)
    logits = apply_logit_bias_batch(apply_penalties_batch(logits, rows), rows)
    is_finite = torch.isfinite(logits) if disallowed is None else torch.isfinite(logits) | disallowed
    is_finite = is_finite.all(dim=-1)  # [N]
    tokens = logits.argmax(dim=-1)  # [N]: the greedy rows' tokens; the random rows' are replaced below
    random_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    if random_rows:
        index = _to_device(random_rows, torch.long, logits.device)
        probs = filtered_probs(logits.index_select(0, index), [rows[i].params for i in random_rows])
        drawn = _exponential_race(probs, [rows[i].generator for i in random_rows], generator)
        tokens = tokens.index_copy(0, index, drawn)
    logprob_rows = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    num_top = min(max((rows[i].params.logprobs for i in logprob_rows), default=0), logits.shape[-1])
    parts = [tokens.masked_fill(~is_finite, -1)]
    if logprob_rows:
        index = _to_device(logprob_rows, torch.long, logits.device)
        logprobs = torch.log_softmax(logits.index_select(0, index), dim=-1)  # [L, V]
        parts.append(logprobs.gather(-1, tokens.index_select(0, index)[:, None]).squeeze(-1))
        if num_top:
            top = logprobs.topk(num_top, dim=-1)  # [L, num_top], each row cut to its own k on the host
            parts += [top.indices.flatten(), top.values.flatten()]
    values = torch.cat([part.to(torch.float64) for part in parts]).tolist()  # the one device-to-host transfer
    return _unpack(values, rows, logprob_rows, num_top)


def apply_token_mask(logits: torch.Tensor, mask: TokenMask | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [N, V] -> (a copy with the disallowed tokens at -inf, those positions [N, V] bool); (`logits`, None)
    without a mask. One copy of the N * V / 32 words to the device (no wait: see `TokenMask`) and three device ops:
    the words read as bytes (byte k of word w: tokens 32 * w + 8 * k + j, its bit j; little-endian, as x86 hosts
    and the GPUs are), each byte's bits tested at once, the logits filled."""
    if mask is None:
        return logits, None
    num_rows, num_vocab = logits.shape
    if mask.bitmask.shape != (num_rows, (num_vocab + 31) // 32):
        raise ValueError(f"token mask: bitmask of shape {tuple(mask.bitmask.shape)} for logits of shape "
                         f"{tuple(logits.shape)}: one row of ceil(V / 32) words per logits row")
    words = mask.bitmask.to(logits.device, non_blocking=True)  # [N, W] int32
    bytes_ = words.view(torch.uint8)  # [N, 4W]
    disallowed = ((bytes_[:, :, None] & _byte_bits(logits.device)) == 0).flatten(1)[:, :num_vocab]  # [N, V]
    return logits.masked_fill(disallowed, float("-inf")), disallowed


@functools.cache
def _byte_bits(device: torch.device) -> torch.Tensor:
    """[8] uint8 on `device`: 1 << j, bit j of a byte; made once per device."""
    return _to_device([1 << j for j in range(8)], torch.uint8, device)


def apply_penalties_batch(logits: torch.Tensor, rows: Sequence[RowInputs]) -> torch.Tensor:
    """logits [N, V] -> penalised copy (`logits` itself when no row has penalties): `apply_penalties` on each row,
    built for the P rows with penalties as a seen-token mask [P, V] and output-token counts [P, V], indexed flat."""
    penalised = [i for i, row in enumerate(rows) if row.params.has_penalties]
    if not penalised:
        return logits
    num_vocab = logits.shape[-1]
    seen: list[int] = []  # p * V + token id: row p (among the penalised) has seen the token
    generated: list[int] = []  # the same for each generated token, repeats included: they count
    for p, i in enumerate(penalised):
        row = rows[i]
        if row.params.repetition_penalty != 1.0:
            seen += [p * num_vocab + t for t in set(row.prompt_ids) | set(row.output_ids)]
        if row.params.presence_penalty or row.params.frequency_penalty:
            generated += [p * num_vocab + t for t in row.output_ids]
    device = logits.device
    flat = _to_device(seen + generated, torch.long, device)
    knobs = _to_device([[rows[i].params.repetition_penalty, rows[i].params.presence_penalty,
                         rows[i].params.frequency_penalty] for i in penalised], logits.dtype, device)
    repetition, presence, frequency = knobs[:, 0:1], knobs[:, 1:2], knobs[:, 2:3]  # [P, 1] each
    index = _to_device(penalised, torch.long, device)
    sub = logits.index_select(0, index)  # [P, V]
    is_seen = torch.zeros(sub.numel(), dtype=torch.bool, device=device).index_fill_(0, flat[:len(seen)], True)
    sub = torch.where(is_seen.view_as(sub), torch.where(sub > 0, sub / repetition, sub * repetition), sub)
    ones = torch.ones(len(generated), dtype=sub.dtype, device=device)
    counts = torch.zeros(sub.numel(), dtype=sub.dtype, device=device).index_add_(0, flat[len(seen):], ones)
    counts = counts.view_as(sub)
    sub = sub - (frequency * counts + presence * (counts > 0).to(sub.dtype))
    return logits.index_copy(0, index, sub)


def apply_logit_bias_batch(logits: torch.Tensor, rows: Sequence[RowInputs]) -> torch.Tensor:
    """logits [N, V] -> a copy with each row's logit bias added (`logits` itself when no row has one): one
    index_add over the flat (row * V + token) positions, built on the host and copied without a sync. The token
    ids are the engine's to check against V when the request arrives (`Engine.add_request`)."""
    flat: list[int] = []
    values: list[float] = []
    num_vocab = logits.shape[-1]
    for i, row in enumerate(rows):
        for token, bias in row.params.logit_bias:
            flat.append(i * num_vocab + token)
            values.append(bias)
    if not flat:
        return logits
    biased = logits.reshape(-1).index_add(0, _to_device(flat, torch.long, logits.device),
                                          _to_device(values, logits.dtype, logits.device))
    return biased.view_as(logits)


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits [R, V] of random rows -> unnormalised probs [R, V] after each row's temperature, top-k, min-p and
    top-p, filtered tokens at 0 (`sample`'s semantics, each row with its own knobs)."""
    num_vocab = logits.shape[-1]
    knobs = _to_device([[p.temperature, min(p.top_k or num_vocab, num_vocab), p.top_p, p.min_p] for p in params],
                       torch.float32, logits.device)
    temperature, top_k, top_p, min_p = (knobs[:, j:j + 1] for j in range(4))  # [R, 1] each
    logits = logits / temperature
    if not any(p.top_k or p.top_p < 1 for p in params):
        probs = torch.softmax(logits, dim=-1)
        return probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    # One sort serves both: top-k compares with the k-th largest logit, top-p walks the probabilities in the same
    # order (softmax keeps it), so every filter runs in sorted order and the result is scattered back once.
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    kth = sorted_logits.gather(-1, top_k.long() - 1)  # a row without top-k has k = V: nothing is below
    probs = torch.softmax(sorted_logits.masked_fill(sorted_logits < kth, float("-inf")), dim=-1)
    probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    # Drop a token when the tokens ranked above it already cover top_p; the first token always stays. A row with
    # top_p = 1 keeps all: its cumsum may round above 1.
    drop = (probs.cumsum(dim=-1) - probs > top_p) & (top_p < 1.0)
    return torch.zeros_like(probs).scatter_(-1, order, probs.masked_fill(drop, 0.0))


def _to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list -> a tensor on `device` without waiting for the GPU: a blocking host-to-device copy synchronises
    the stream, i.e. waits for the forward pass still queued on it, and so may a non-blocking one from pageable
    memory (CUDA stages it through a buffer of its own), so on CUDA the list is copied from page-locked memory."""
    tensor = torch.tensor(data, dtype=dtype)
    if torch.device(device).type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def _exponential_race(probs: torch.Tensor, generators: Sequence[torch.Generator | None],
                      generator: torch.Generator | None) -> torch.Tensor:
    """probs [R, V] (unnormalised) -> token ids [R]: argmax(probs / E), E ~ Exponential(1) per token, picks token
    i with probability probs[i] / sum(probs) (the Gumbel-max trick), and unlike multinomial lets each row draw its
    noise from its own generator."""
    noise = torch.empty_like(probs)
    if any(g is None for g in generators):
        noise.exponential_(generator=generator)
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)  # [V] whatever the batch: the same draws alone or batched
    # A draw of exactly 0 would make a filtered token's 0 / 0 a NaN, which argmax takes for the maximum.
    return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def _unpack(values: list[float], rows: Sequence[RowInputs], logprob_rows: list[int], num_top: int) -> SampleResult:
    """`sample_batch`'s packed transfer -> per-row results: N tokens, then L sampled logprobs, then L * num_top top
    ids and as many top logprobs (L: the rows asking for logprobs)."""
    num_rows, num_logprob_rows = len(rows), len(logprob_rows)
    tokens = [int(v) for v in values[:num_rows]]
    logprobs: list[float | None] = [None] * num_rows
    top_logprobs: list[tuple[tuple[int, float], ...] | None] = [None] * num_rows
    top_ids = values[num_rows + num_logprob_rows:][:num_logprob_rows * num_top]
    top_values = values[num_rows + num_logprob_rows + num_logprob_rows * num_top:]
    for j, i in enumerate(logprob_rows):
        if tokens[i] < 0:
            continue
        logprobs[i] = values[num_rows + j]
        k = rows[i].params.logprobs
        ids, lps = top_ids[j * num_top:j * num_top + k], top_values[j * num_top:j * num_top + k]
        top_logprobs[i] = tuple((int(t), lp) for t, lp in zip(ids, lps, strict=True))
    errors = [NON_FINITE_LOGITS if token < 0 else None for token in tokens]
    return SampleResult(tokens, logprobs, top_logprobs, errors)
