"""DeepSeek Sparse Attention models: DeepSeek-V3.2 (`DeepseekV32ForCausalLM`: V3.2-Exp, V3.2, V3.2-Speciale) and
GLM-5 / 5.1 / 5.2 (`GlmMoeDsaForCausalLM`).

Both are DeepSeek-V3 (MLA with q LoRA and an interleaved rope on the shared key; sigmoid-scored grouped routing
with a correction bias, shared experts, dense first layers) with a lightning indexer in every attention layer
(`hybrid.layers.mla.Indexer`): it caches a LayerNorm'd, rotated 128-wide key per token, scores every visible
token per query and the attention reads only the top `index_topk` (2048). The two differ in the indexer's RoPE
(DeepSeek-V3.2 rotates halves, GLM interleaved pairs, each as its reference does), in its heads (64 / 32) and in
GLM's dims (qk_nope 192, v_head 256). GLM-5.2 marks layers "shared" (`indexer_types`, or the
`index_topk_freq` / `index_skip_topk_offset` schedule): they reuse the previous full layer's selection and ship no
indexer weights. The checkpoints' multi-token-prediction layers past num_hidden_layers are skipped.

Defaults are transformers' `DeepseekV32Config` / `GlmMoeDsaConfig`'s, for keys a config leaves out.
"""

from __future__ import annotations

import re
from dataclasses import replace

from hybrid.config import IndexerConfig, LayerSpec, ModelConfig, RawConfig
from hybrid.models.base import MoECausalLM
from hybrid.models.deepseek import _deepseek_config, v3_moe_config

INDEXER_TYPES = ("full", "shared")


def _indexer_types(raw: RawConfig, num_layers: int) -> list[str]:
    """GLM's per-layer indexer modes, as transformers' GlmMoeDsaConfig derives them: `indexer_types`, else an
    `index_topk_pattern` ("F"/"S" per layer), else full on layer i when max(i - offset + 1, 0) % freq == 0."""
    types = raw.get("indexer_types")
    if types is None and (pattern := raw.get("index_topk_pattern")) is not None:
        if isinstance(pattern, str) and set(pattern) <= {"F", "S"}:
            types = [{"F": "full", "S": "shared"}[c] for c in pattern]
        else:
            types = pattern
    if types is None:
        freq = max(raw.int("index_topk_freq", 1), 1)
        offset = raw.int("index_skip_topk_offset", 2)
        return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or any(t not in INDEXER_TYPES for t in types):
        raise raw.error(f"'indexer_types' must list 'full' or 'shared' for each of the {num_layers} layers")
    if types and types[0] != "full":
        raise raw.error("'indexer_types' starts with a 'shared' layer: it has no earlier selection to reuse")
    return types


def _dsa_config(raw: RawConfig, checkpoint_dir, *, is_indexer_rope_interleaved: bool, default_index_heads: int,
                default_scaling: float, has_shared_layers: bool) -> ModelConfig:
    moe = v3_moe_config(raw, default_scaling=default_scaling, default_num_shared=1)
    # transformers' DSA configs have no rope_interleave: the main attention's rope is always DeepSeek's pairs
    config = _deepseek_config(raw, checkpoint_dir, moe, is_interleaved=True, default_first_dense=3)
    attention = config.attention
    if attention.q_lora_rank is None:
        raise raw.error("q_lora_rank is null; the DSA indexer reads the query LoRA's output, so it must be set")
    layer_types = raw.get("layer_types")
    if layer_types is not None and any(t != "deepseek_sparse_attention" for t in layer_types):
        raise raw.error("'layer_types' lists a layer kind other than 'deepseek_sparse_attention'; only DSA layers "
                        "are supported in this architecture")
    indexer = IndexerConfig(
        num_heads=raw.int("index_n_heads", default_index_heads),
        head_dim=raw.int("index_head_dim", 128),
        topk=raw.int("index_topk", 2048),
        is_rope_interleaved=is_indexer_rope_interleaved,
    )
    if indexer.head_dim < attention.qk_rope_head_dim:
        raise raw.error(f"index_head_dim {indexer.head_dim} is smaller than qk_rope_head_dim "
                        f"{attention.qk_rope_head_dim}, which the indexer rotates")
    types = _indexer_types(raw, config.num_layers) if has_shared_layers else ["full"] * config.num_layers
    kinds = {kind: replace(attention, indexer=replace(indexer, is_shared=kind == "shared")) for kind in INDEXER_TYPES}
    specs = tuple(LayerSpec(kinds[kind], config.rope, "moe" if is_moe else "dense")
                  for kind, is_moe in zip(types, config.moe_layers, strict=True))
    return replace(config, attention=kinds["full"], layer_specs=specs)


class DeepseekV32ForCausalLM(MoECausalLM):
    has_mtp_layers = True

    @classmethod
    def parse_config(cls, raw: RawConfig, checkpoint_dir=None) -> ModelConfig:
        return _dsa_config(raw, checkpoint_dir, is_indexer_rope_interleaved=False, default_index_heads=64,
                           default_scaling=2.5, has_shared_layers=False)


class GlmMoeDsaForCausalLM(MoECausalLM):
    has_mtp_layers = True

    @classmethod
    def parse_config(cls, raw: RawConfig, checkpoint_dir=None) -> ModelConfig:
        return _dsa_config(raw, checkpoint_dir, is_indexer_rope_interleaved=True, default_index_heads=32,
                           default_scaling=2.5, has_shared_layers=True)

    def is_ignored_tensor(self, name: str) -> bool:
        # a shared layer runs no indexer; a checkpoint that still carries its weights loads without them
        match = re.match(r"model\.layers\.(\d+)\.self_attn\.indexer\.", name)
        if match and int(match.group(1)) < self.config.num_layers:
            indexer = self.config.layers[int(match.group(1))].attention.indexer
            if indexer is not None and indexer.is_shared:
                return True
        return super().is_ignored_tensor(name)
