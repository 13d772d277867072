"""Skewed, drifting expert popularity written into a synthetic checkpoint (`hybrid-bench decode --skewed-routing`):
the routing of real models is skewed (a few experts per layer take much of the traffic) and shifts with the text,
which a random synthetic model's near-uniform routing does not show; dynamic hot experts (`hybrid.hot_experts`)
are measured on this instead of assumed. Nothing at run time is patched: the effect is in the weights.

The vocabulary is cut into `num_phases` bands (token id mod num_phases), each with a unit direction D[p] in the
hidden space. Tensors written instead of the pool's tiles (everything else is `hybrid.synthetic`'s):
- the token embeddings: S x (D[band] + u_t), u_t the token's own direction (its pool tile, norm ~1), S large
  against what the random layers add to the residual stream, so every layer's hidden state points along its
  token's band;
- the RMSNorm weights before the routers and the final one: ones (the pool's random signs would scramble the
  direction);
- each MoE layer's router: logits = Z[layer, band, e] + N(0, sigma) per token, where Z is -zipf x ln(rank + 1) over
  a random permutation of the experts per layer and band: Zipf-skewed, a different favourite set per band;
- lm_head: tokens of the current token's band get ln(tokens_per_shift x (num_phases - 1)) more logit, so a sampled
  decode (temperature 1, as the benchmark's) stays in its band for about `tokens_per_shift` tokens, then drifts to
  another band, and the hot experts with it.
Deterministic from `seed`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybrid.errors import ConfigError

EMBEDDING_SCALE = 64.0  # x sqrt(layers): the band direction against the random layers' additions (~10 each)


@dataclass(frozen=True)
class SkewedRouting:
    zipf: float = 1.0  # expert of rank r (0 first) gets logit -zipf x ln(r + 1)
    num_phases: int = 4  # vocabulary bands, each with its own expert ranking per layer
    tokens_per_shift: int = 256  # mean sampled tokens between band shifts
    noise: float = 1.0  # per-token routing noise (std of the logits' random part)
    seed: int = 0

    def __post_init__(self):
        if self.zipf < 0 or self.num_phases < 2 or self.tokens_per_shift < 1 or self.noise < 0:
            raise ConfigError(f"skewed routing: zipf >= 0, num_phases >= 2, tokens_per_shift >= 1 and noise >= 0 "
                              f"expected, got {self}")

    def tensors(self, model) -> dict[str, callable]:
        """The model's checkpoint name -> a function of its pool tile (bf16) giving the tensor to write instead."""
        config = model.config
        hidden, num_experts = config.hidden_size, config.moe.num_experts
        names = set(model.checkpoint_targets())
        gen = torch.Generator().manual_seed(self.seed)
        directions = torch.nn.functional.normalize(torch.randn(self.num_phases, hidden, generator=gen), dim=1)
        scale = EMBEDDING_SCALE * math.sqrt(config.num_layers)
        boost = math.log(self.tokens_per_shift * (self.num_phases - 1))
        tile_norm = 0.02 * math.sqrt(hidden)  # a pool tile's row norm (std 0.02)
        out = {}

        def banded(rows: int) -> torch.Tensor:
            return directions[torch.arange(rows) % self.num_phases]  # [V, H]

        out["model.embed_tokens.weight"] = lambda tile: (
            scale * (banded(tile.shape[0]) + tile.float() / tile_norm)).to(tile.dtype)
        out["lm_head.weight"] = lambda tile: (
            tile.float() + boost * math.sqrt(2 / hidden) * banded(tile.shape[0])).to(tile.dtype)
        out["model.norm.weight"] = torch.ones_like
        for layer in config.moe_layer_indices:
            out[f"model.layers.{layer}.post_attention_layernorm.weight"] = torch.ones_like
            ranks = torch.stack([torch.randperm(num_experts, generator=gen) for _ in range(self.num_phases)])
            logits = -self.zipf * torch.log1p(ranks.float())  # [P, E]: expert e's logit under band p
            noise = torch.randn(num_experts, hidden, generator=gen)  # R_e . u_t ~ N(0, 1)
            # h after the norm ~ sqrt(H / 2) (D[p] + u_t): W = sqrt(2 / H) (Z^T D + sigma R) gives Z[p] + sigma R.u_t
            router = math.sqrt(2 / hidden) * (logits.T @ directions + self.noise * noise)  # [E, H]
            out[f"model.layers.{layer}.mlp.gate.weight"] = lambda tile, w=router: w.to(tile.dtype)
        missing = sorted(set(out) - names)
        if missing:
            raise ConfigError(f"skewed routing: {config.architecture} has no tensor '{missing[0]}'; use a Qwen3-MoE "
                              "shape (--synthetic qwen3-30b-a3b)")
        return out
