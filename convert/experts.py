"""The routed experts' format in the output (`--expert-dtype`, `--group-size`), resolved against the source.

`--expert-dtype auto` (the default) keeps a quantized source's expert format where hybrid's CPU experts hold it as
it is, and uses int8 otherwise: FP8 e4m3 with block or channel scales (DeepSeek-V3/V3.2, GLM-5, MiniMax-M2, Qwen
FP8 releases; DeepSeek-V4's E8M0 block scales), MXFP4, NVFP4 (ModelOpt, compressed-tensors `nvfp4-pack-quantized`)
and compressed-tensors `pack-quantized` INT4 (Kimi-K2-Thinking, K2.5, K2.6: symmetric, groups of 32 along K,
bfloat16 scales) are copied bit for bit (`hybrid.native_experts`, layouts in `hybrid.stored_matrix`). The same dtype
asked for explicitly copies them too, unless `--group-size` asks for another group; any other format is quantized
from the dequantized source (a second rounding, said in a note). Experts stored fused per layer are read by
`hybrid.fused_experts`: gpt-oss's published MXFP4 is copied as stored, float ones (gpt-oss bf16, Qwen3.5) quantized.
"""

from __future__ import annotations

from convert.options import ConvertOptions
from convert.plan import Plan
from hybrid import native_experts
from hybrid.fused_experts import fused_source
from hybrid.native_experts import ExpertFormat, SourceFormat

__all__ = ["ExpertFormat", "resolve", "routed_expert_names", "source_expert_format"]


def resolve(plan: Plan, options: ConvertOptions) -> ExpertFormat:
    """The output's expert format for this source under `options` (see the module docstring)."""
    return native_experts.resolve(source_expert_format(plan), options.expert_dtype, options.group_size)


def routed_expert_names(plan: Plan) -> list[str]:
    config = plan.config
    return [plan.expert_name(layer, e, role) for layer in config.moe_layer_indices
            for e in range(config.moe.num_experts) for role in ("gate", "up", "down")]


def source_expert_format(plan: Plan) -> SourceFormat | None:
    """The format every routed expert of the source is stored in, when the CPU experts hold it as it is."""
    if plan.fused:
        return fused_source(list(plan.fused.values()))
    return native_experts.source_format(plan.ckpt, routed_expert_names(plan))
