"""Calibration for GPTQ, streamed layer by layer: the calibration text's hidden states go through the source
model one decoder layer at a time (only that layer's weights in memory, float32, the runtime's own layer
code and a KV cache for just that layer), and every GPU Linear of the layer accumulates the Hessian of its
inputs, H = 2/N * sum x x^T. The layer's output becomes the next layer's input (computed with the original
weights, so errors do not compound through the calibration). Weights that are not applied as a Linear call
(MLA's kv_b_proj, used by weight absorption) get no Hessian and fall back to round-to-nearest.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from convert.plan import TOKENIZER_FILES, Plan, has_tokenizer
from hybrid.block_manager import blocks_needed
from hybrid.cache_groups import CacheGroup
from hybrid.errors import ConfigError
from hybrid.forward_batch import ForwardBatch, SequenceSlice
from hybrid.kv_cache import allocate_kv_cache
from hybrid.models.base import checkpoint_targets_of

SEQUENCE_LEN = 512  # calibration text is cut into sequences of this many tokens
BLOCK_SIZE = 16


def calibration_tokens(source: Path, calib_file: Path, num_tokens: int) -> list[int]:
    from transformers import AutoTokenizer

    if not has_tokenizer(source):
        raise ConfigError(f"{source}: --calib-file needs the checkpoint's tokenizer (none of "
                          f"{', '.join(TOKENIZER_FILES)} found)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{source}: --calib-file needs the checkpoint's tokenizer files ({exc})") from None
    try:
        text = Path(calib_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--calib-file {calib_file}: cannot read it as UTF-8 text ({exc})") from None
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:num_tokens]
    if len(ids) < 16:
        raise ConfigError(f"--calib-file {calib_file}: only {len(ids)} tokens; give at least 16")
    return ids


class Calibrator:
    def __init__(self, plan: Plan, calib_file: Path, num_tokens: int, targets: set[str]):
        self.plan = plan
        self.targets = targets
        ids = torch.tensor(calibration_tokens(plan.source, calib_file, num_tokens))
        self.lengths = [len(chunk) for chunk in ids.split(SEQUENCE_LEN)]
        embed = plan.read("model.embed_tokens.weight").float()
        self.hidden = nn.functional.embedding(ids, embed)  # [T, H]
        self.residual = None  # the residual stream the layers pass on (its add is in the next layer's norm)
        self.next_layer = 0
        self._hessians: dict[str, torch.Tensor] = {}

    def hessian(self, name: str) -> torch.Tensor | None:
        """The normalized input Hessian [K, K] of the Linear whose weight is `name`, None if it has none."""
        match = re.match(r"model\.layers\.(\d+)\.", name)
        if match is None:
            return None
        while self.next_layer <= int(match.group(1)):
            self._run_layer(self.next_layer)
            self.next_layer += 1
        return self._hessians.pop(name, None)

    def _batch(self) -> ForwardBatch:
        seqs, first = [], 0
        for length in self.lengths:
            num_blocks = blocks_needed(length, BLOCK_SIZE)
            seqs.append(SequenceSlice(0, length, [list(range(first, first + num_blocks))]))
            first += num_blocks
        self.num_blocks = first
        return ForwardBatch.build(seqs, BLOCK_SIZE, "cpu")

    @torch.no_grad()
    def _run_layer(self, index: int) -> None:
        prefix = f"model.layers.{index}."
        layer = self.plan.model.model.layers[index]
        layer.to_empty(device="cpu")  # this layer only; back to meta below
        try:
            for name, target in checkpoint_targets_of(layer, prefix).items():
                if name in self.plan.ckpt.parts:
                    target.copy_(self.plan.read(name))  # NaN here would reach every later Hessian
            for module in layer.modules():
                if hasattr(module, "reset_buffers"):
                    module.reset_buffers()
            batch = self._batch()
            group = CacheGroup((0,), tuple(layer.self_attn.kv_cache_shapes()), None, self.num_blocks)
            allocate_kv_cache([layer.self_attn], [group], BLOCK_SIZE, torch.float32, "cpu")
            sums, hooks = {}, []
            for module_name, module in layer.named_modules(prefix=prefix.rstrip(".")):
                if isinstance(module, nn.Linear) and f"{module_name}.weight" in self.targets:
                    hooks.append(module.register_forward_hook(_accumulate(sums, f"{module_name}.weight")))
            try:
                self.hidden, self.residual = layer(self.hidden, self.residual, batch)
            finally:
                for hook in hooks:
                    hook.remove()
            self._hessians.update({name: 2.0 * xtx / count for name, (xtx, count) in sums.items()})
        finally:
            layer.self_attn.kv_cache = ()
            layer.to_empty(device="meta")


def _accumulate(sums: dict, name: str):
    def hook(module, inputs, output):
        x = inputs[0].reshape(-1, inputs[0].shape[-1]).float()  # [T, K]
        xtx, count = sums.get(name, (0.0, 0))
        sums[name] = (xtx + x.t() @ x, count + x.shape[0])

    return hook
