"""Kimi-K2.5 / K2.6 (`KimiK25ForConditionalGeneration`): a vision-language wrapper around the DeepSeek-V3 text model
of Kimi-K2 (`text_config`, model_type `kimi_k2`), served as text only.

The published checkpoint keeps the text model under `language_model.model.*` and `language_model.lm_head.*`,
mapped to the DeepSeek-V3 names by the checkpoint reader (`checkpoint_prefixes`), so loading stays a copy; the
vision tower (`vision_tower.*`) and the projector (`mm_projector.*`) are skipped by the loader and the converter.
"""

from __future__ import annotations

import logging

from hybrid.config import ModelConfig, RawConfig, wrapped_text_config
from hybrid.models.deepseek import DeepseekV3ForCausalLM

log = logging.getLogger(__name__)




class KimiK25ForConditionalGeneration(DeepseekV3ForCausalLM):
    checkpoint_prefixes = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."))
    ignored_tensor_patterns = (*DeepseekV3ForCausalLM.ignored_tensor_patterns, r"vision_tower\.", r"mm_projector\.")

    @classmethod
    def parse_config(cls, raw: RawConfig, checkpoint_dir=None) -> ModelConfig:
        text = wrapped_text_config(raw, "the DeepSeek-V3 text model's settings, as Kimi-K2.5 publishes them")
        config = super().parse_config(text, checkpoint_dir)
        if raw.has("vision_config"):
            log.warning("%s: Kimi-K2.5's vision tower and projector are not loaded: image inputs are not supported, "
                        "text only", raw.source)
        return config
