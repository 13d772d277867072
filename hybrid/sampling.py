"""Token sampling from float32 logits: greedy, or temperature with top-k, top-p and min-p filtering; repetition
(HF's: seen tokens' logits divided, or multiplied when negative), presence and frequency (OpenAI's: subtracted per
generated token) penalties applied first."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


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
    """logits [V] float32 of one sequence -> penalised copy."""
    logits = logits.clone()
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=logits.device)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        ids = torch.tensor(output_ids, dtype=torch.long, device=logits.device)
        counts = torch.zeros_like(logits).index_add_(0, ids, torch.ones_like(ids, dtype=logits.dtype))
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits
