"""The Gated DeltaNet layer (`linear_attn` of Qwen3-Next and Qwen3.5), as transformers' `Qwen3NextGatedDeltaNet` /
`Qwen3_5GatedDeltaNet` compute it:

input projections -> causal depthwise conv1d over the q/k/v channels (SiLU) -> q and k L2-normalised and repeated
to the v-head count, beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias) -> the gated delta rule over a
float32 recurrent state [Hv, Dk, Dv] -> `w * norm(core) * silu(z)` -> out_proj.

A sequence's states live in the layer's slot pools (`state_cache`: recurrent [num_slots, Hv, Dk, Dv] float32 and
conv [num_slots, conv_dim, K - 1], bound with the KV cache, `hybrid.kv_cache.allocate_state_cache`); the step names
each sequence's slot (`ForwardBatch.state_slots`) and whether its chunk resumes the sequence
(`has_initial_state`: else the states start from zero). The conv and the delta rule run in the attention backend
(`gated_delta_rule`, `causal_conv1d`): on the Triton backend `gpu_layers.delta_net`'s kernels where they take the
layer's dims (prefill over the packed chunks, decode one token a row by slot, CUDA-graph safe), else the
plain-PyTorch functions below, one token at a time in float32 (the kernels' oracle).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.config import LinearAttentionConfig
from hybrid.forward_batch import ForwardBatch
from hybrid.layers.norm import GatedRMSNorm

L2_EPS = 1e-6  # transformers' l2norm (FLA's convention)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def causal_conv1d_seq(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, has_initial: bool) -> torch.Tensor:
    """One sequence's chunk: x [T, C], weight [C, K], state [C, K - 1] (the inputs before the chunk; updated in place
    to the chunk's last K - 1, counting what came before) -> silu(conv) [T, C]."""
    history = state.to(x.dtype) if has_initial else x.new_zeros(state.shape)
    full = torch.cat((history, x.T), dim=1)  # [C, K - 1 + T]
    state.copy_(full[:, -state.shape[1]:])
    out = F.conv1d(full.unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), groups=weight.shape[0])[0]
    return F.silu(out).T.to(x.dtype)


def gated_delta_rule_seq(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor) -> torch.Tensor:
    """One sequence's chunk, token by token in float32: q, k [T, H, Dk] (not yet normalised), v [T, H, Dv], g, beta
    [T, H]; `state` float32 [H, Dk, Dv], updated in place -> [T, H, Dv] in v's dtype."""
    dtype = v.dtype
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    q, k = l2norm(q) / (q.shape[-1] ** 0.5), l2norm(k)
    s = state.clone()
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        kv_mem = (s * k[t].unsqueeze(-1)).sum(dim=-2)  # [H, Dv]
        delta = (v[t] - kv_mem) * beta[t].unsqueeze(-1)
        s = s + k[t].unsqueeze(-1) * delta.unsqueeze(-2)
        out[t] = (s * q[t].unsqueeze(-1)).sum(dim=-2)
    state.copy_(s)
    return out.to(dtype)


def torch_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor,
                        batch: ForwardBatch) -> torch.Tensor:
    """x [T, C] of the step's sequences -> [T, C]; each sequence's conv state is `conv_pool[its slot]`."""
    out, start = [], 0
    for n, slot, resumes in zip(batch.query_lens_cpu, batch.state_slots_cpu, batch.has_initial_state_cpu,
                                strict=True):
        out.append(causal_conv1d_seq(x[start:start + n], weight, conv_pool[slot], resumes))
        start += n
    return torch.cat(out)


def torch_gated_delta_rule(q, k, v, g, beta, state_pool: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv] of the step's sequences -> [T, Hv, Dv] (q and k repeated to
    the v heads, each k head serving Hv / Hk consecutive v heads); each sequence's state is `state_pool[its slot]`,
    zeroed first unless its chunk resumes the sequence."""
    ratio = v.shape[1] // q.shape[1]
    if ratio > 1:
        q, k = q.repeat_interleave(ratio, dim=1), k.repeat_interleave(ratio, dim=1)
    out, start = [], 0
    for n, slot, resumes in zip(batch.query_lens_cpu, batch.state_slots_cpu, batch.has_initial_state_cpu,
                                strict=True):
        if not resumes:
            state_pool[slot].zero_()
        rows = slice(start, start + n)
        out.append(gated_delta_rule_seq(q[rows], k[rows], v[rows], g[rows], beta[rows], state_pool[slot]))
        start += n
    return torch.cat(out)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: LinearAttentionConfig, hidden_size: int, backend):
        super().__init__()
        self.cfg = cfg
        self.key_dim, self.value_dim = cfg.num_k_heads * cfg.head_k_dim, cfg.num_v_heads * cfg.head_v_dim
        if cfg.projection == "qkvz_ba":
            self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(hidden_size, 2 * cfg.num_v_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(hidden_size, 2 * self.key_dim + self.value_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden_size, cfg.num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden_size, cfg.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.conv_kernel, groups=cfg.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(cfg.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(cfg.num_v_heads))
        self.norm = GatedRMSNorm(cfg.head_v_dim, cfg.eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self.backend = backend
        self.state_cache: tuple[torch.Tensor, ...] = ()  # (recurrent pool, conv pool), bound with the KV cache

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.cfg.state_shapes()

    def _project(self, x: torch.Tensor):
        """x [T, H] -> q, k [T, Hk * Dk], v [T, Hv * Dv], z [T, Hv, Dv], b, a [T, Hv]."""
        cfg, num_tokens = self.cfg, x.shape[0]
        if cfg.projection == "qkvz_ba":  # grouped per k-head: [q | k | v of its v-heads | z of its v-heads]
            ratio = cfg.num_v_heads // cfg.num_k_heads
            qkvz = self.in_proj_qkvz(x).view(num_tokens, cfg.num_k_heads, -1)
            q, k, v, z = qkvz.split([cfg.head_k_dim, cfg.head_k_dim, ratio * cfg.head_v_dim,
                                     ratio * cfg.head_v_dim], dim=-1)
            b, a = self.in_proj_ba(x).view(num_tokens, cfg.num_k_heads, 2 * ratio).split(ratio, dim=-1)
            flat = (t.reshape(num_tokens, -1) for t in (q, k, v, b, a))
            q, k, v, b, a = flat
        else:
            q, k, v = self.in_proj_qkv(x).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
            z, b, a = self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        return q, k, v, z.reshape(num_tokens, cfg.num_v_heads, cfg.head_v_dim), b, a

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        cfg, num_tokens = self.cfg, x.shape[0]
        state_pool, conv_pool = self.state_cache
        q, k, v, z, b, a = self._project(x)
        mixed = self.backend.causal_conv1d(torch.cat((q, k, v), dim=-1), self.conv1d.weight[:, 0], conv_pool, batch)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(num_tokens, cfg.num_k_heads, cfg.head_k_dim)
        k = k.reshape(num_tokens, cfg.num_k_heads, cfg.head_k_dim)
        v = v.reshape(num_tokens, cfg.num_v_heads, cfg.head_v_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # float32: exp(A_log) overflows fp16
        core = self.backend.gated_delta_rule(q, k, v, g, beta.float(), state_pool, batch)  # [T, Hv, Dv]
        out = self.norm(core.reshape(-1, cfg.head_v_dim), z.reshape(-1, cfg.head_v_dim))
        return self.out_proj(out.reshape(num_tokens, self.value_dim))
