"""Random routed-expert weights for the CPU-operator tests (streaming, prefill split)."""

from __future__ import annotations

import torch

from cpu_experts.expert_file import SWIGLU_OAI


def random_experts(generator: torch.Generator, num_experts: int, hidden_size: int, inter: int,
                   is_gpt_oss: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """gate, up [E, I, H], down [E, H, I] and `PackedLayer.from_float`'s extra arguments; `is_gpt_oss`: gpt-oss's
    clamped activation with random biases, gate/up large enough to reach the clamp."""
    gain = 1.5 if is_gpt_oss else 1 / 8
    gate, up = (torch.randn(num_experts, inter, hidden_size, generator=generator) * gain for _ in range(2))
    down = torch.randn(num_experts, hidden_size, inter, generator=generator) / 8
    extra = {}
    if is_gpt_oss:
        extra = dict(activation=SWIGLU_OAI, biases=tuple(torch.randn(num_experts, n, generator=generator)
                                                         for n in (inter, inter, hidden_size)))
    return gate, up, down, extra
