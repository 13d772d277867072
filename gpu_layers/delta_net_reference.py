"""Plain-PyTorch references of `gpu_layers.delta_net` (Gated DeltaNet: Qwen3-Next, Qwen3.5), importable without
Triton: the test oracle of the kernels and the CPU path of the runtime. Same arguments and state pools as the
kernels; everything is computed in float32, token by token, the simplest statement of the math.

Per v head h (k head h // G for G = Hv / Hk, transformers' repeat_interleave), token t, state S [Dk, Dv]:
  q, k <- q / sqrt(|q|^2 + 1e-6), likewise k (always: every GDN model we serve normalises in the kernel); q *= scale
  S <- exp(g_t) S;  S <- S + k (beta_t (v - S^T k))^T;  o_t = S^T q
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6  # transformers' (and fla's) l2norm: x * rsqrt(sum(x^2) + eps)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def causal_conv1d_prefill(x, weight, bias, cu_seqlens, conv_pool, state_slots, has_initial_state) -> torch.Tensor:
    """x [T, C] packed sequences (cu_seqlens [B + 1]), weight [C, K], bias [C] or None -> silu(conv) [T, C] in x's
    dtype. Sequence b continues from conv_pool[state_slots[b]] [C, K - 1] (its previous K - 1 inputs) when
    has_initial_state[b], else from zeros; its last K - 1 inputs (older state columns where it is shorter) are
    written back to that slot."""
    kernel_size = weight.shape[1]
    out = torch.empty_like(x)
    bounds = cu_seqlens.tolist()
    for b, slot in enumerate(state_slots.tolist()):
        start, end = bounds[b], bounds[b + 1]
        history = conv_pool[slot].float() if bool(has_initial_state[b]) else x.new_zeros(
            x.shape[1], kernel_size - 1, dtype=torch.float32)
        inputs = torch.cat((history, x[start:end].float().T), dim=1)  # [C, K - 1 + L]
        conv = F.conv1d(inputs[None], weight.float()[:, None, :], None if bias is None else bias.float(),
                        groups=x.shape[1])[0]  # [C, L]
        out[start:end] = F.silu(conv).T.to(x.dtype)
        conv_pool[slot] = inputs[:, inputs.shape[1] - (kernel_size - 1):].to(conv_pool.dtype)
    return out


def causal_conv1d_decode(x, weight, bias, conv_pool, state_slots) -> torch.Tensor:
    """One token per row: x [B, C] -> [B, C], rolling each row's conv state by one. A row whose slot is < 0 is
    padding: its output is zero and no state is touched."""
    out = torch.zeros_like(x)
    for b, slot in enumerate(state_slots.tolist()):
        if slot < 0:
            continue
        inputs = torch.cat((conv_pool[slot].float(), x[b].float()[:, None]), dim=1)  # [C, K]
        conv = (inputs * weight.float()).sum(1) + (0.0 if bias is None else bias.float())
        out[b] = F.silu(conv).to(x.dtype)
        conv_pool[slot] = inputs[:, 1:].to(conv_pool.dtype)
    return out


def _delta_rule_steps(q, k, v, g, beta, state, scale):
    """q, k [L, Hv, Dk] (already repeated to the v heads), v [L, Hv, Dv], g, beta [L, Hv], state [Hv, Dk, Dv], all
    float32 -> (o [L, Hv, Dv], final state)."""
    q, k = l2norm(q) * scale, l2norm(k)
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        predicted = torch.einsum("hkv,hk->hv", state, k[t])
        delta = (v[t] - predicted) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", state, q[t])
    return out, state


def _repeated(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    return x.float().repeat_interleave(num_v_heads // x.shape[1], dim=1)


def gated_delta_rule_prefill(q, k, v, g, beta, cu_seqlens, state_pool, state_slots, has_initial_state,
                             scale: float) -> torch.Tensor:
    """q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv] packed sequences (cu_seqlens [B + 1]) -> o [T, Hv, Dv] in
    v's dtype. Sequence b starts from state_pool[state_slots[b]] [Hv, Dk, Dv] (float32) when has_initial_state[b],
    else from zeros, and its final state is written back there."""
    num_v_heads = v.shape[1]
    out = torch.empty_like(v)
    bounds = cu_seqlens.tolist()
    for b, slot in enumerate(state_slots.tolist()):
        start, end = bounds[b], bounds[b + 1]
        state = state_pool[slot].float() if bool(has_initial_state[b]) else torch.zeros_like(state_pool[slot])
        o, state = _delta_rule_steps(_repeated(q[start:end], num_v_heads), _repeated(k[start:end], num_v_heads),
                                     v[start:end].float(), g[start:end].float(), beta[start:end].float(), state,
                                     scale)
        out[start:end] = o.to(v.dtype)
        state_pool[slot] = state
    return out


def gated_delta_rule_decode(q, k, v, g, beta, state_pool, state_slots, scale: float) -> torch.Tensor:
    """One token per row: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv] -> [B, Hv, Dv], updating each row's
    state in its slot. A row whose slot is < 0 is padding: its output is zero and no state is touched."""
    num_v_heads = v.shape[1]
    out = torch.zeros_like(v)
    for b, slot in enumerate(state_slots.tolist()):
        if slot < 0:
            continue
        o, state = _delta_rule_steps(_repeated(q[b:b + 1], num_v_heads), _repeated(k[b:b + 1], num_v_heads),
                                     v[b:b + 1].float(), g[b:b + 1].float(), beta[b:b + 1].float(),
                                     state_pool[slot].float(), scale)
        out[b] = o[0].to(v.dtype)
        state_pool[slot] = state
    return out
