"""Routed experts stored fused per layer (one tensor per projection holding all E experts), read expert by expert
into the expert file's entries (`cpu_experts.expert_file`: `gate.weight`, `gate.scales`, ..., `gate.bias`). One
reader per layout, shared by the converter (`convert.units`) and the runtime that serves a checkpoint directly
(`hybrid.direct_experts`), so both give the same bits; one expert's rows in memory at a time (a layer of
gpt-oss-120b's bf16 experts is 6 GiB).

Layouts, under `prefix` = `model.layers.N.mlp.experts` (E experts, H hidden, I intermediate):
- GATE_UP_ROWS (Qwen3.5/3.6 as released): `gate_up_proj` [E, 2I, H], gate rows then up rows, `down_proj` [E, H, I];
  float values, quantized to the expert dtype. Its FP8 form (transformers' FP8 experts, `fp8_block` [bn, bk] from
  `quantization_config.weight_block_size`): float8_e4m3fn codes with float32 block scales `gate_up_proj_scale_inv`
  [E, ceil(2I / bn), ceil(H / bk)] and `down_proj_scale_inv` [E, ceil(H / bn), ceil(I / bk)], each block scale
  repeated over its rows (so gate and up may split a block); copied as stored where the expert dtype is that FP8
  format (group bk, float32 scales), else dequantized and quantized to the expert dtype.
- INTERLEAVED (gpt-oss as transformers saves it): `gate_up_proj` [E, H, 2I], input-major, gate and up alternating
  along 2I (gate = columns 0::2), `down_proj` [E, I, H]; biases `gate_up_proj_bias` [E, 2I] (interleaved alike)
  and `down_proj_bias` [E, H]; float values, quantized to the expert dtype.
- INTERLEAVED_MXFP4 (gpt-oss as published, `Mxfp4GptOssExperts`): `gate_up_proj_blocks` uint8 [E, 2I, H/32, 16],
  output-major, gate and up rows interleaved (gate = rows 0::2), `gate_up_proj_scales` E8M0 [E, 2I, H/32],
  `down_proj_blocks` [E, H, I/32, 16], `down_proj_scales` [E, H, I/32], the biases as INTERLEAVED. Copied as
  stored where the expert dtype is MXFP4 (32 columns are 16 bytes, even column in the low nibble, as
  `cpu_experts.formats` packs them), else dequantized and quantized to the expert dtype.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from cpu_experts import formats, memory
from cpu_experts.expert_file import ExpertLayerSpec, quantize_matrix
from hybrid.checkpoint import FP8_SCALE_SUFFIX, Checkpoint
from hybrid.errors import CheckpointError
from hybrid.native_experts import Check, SourceFormat, for_each_expert
from hybrid.stored_matrix import Layout, PartError, StoredMatrix, decode

GATE_UP_ROWS, INTERLEAVED, INTERLEAVED_MXFP4 = "gate_up_rows", "interleaved", "interleaved_mxfp4"
MXFP4_SOURCE = SourceFormat("mxfp4", 32, "e8m0")
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
STORED_DTYPES = {"float": (FLOAT_DTYPES, "a float dtype"), "uint8": ((torch.uint8,), "torch.uint8"),
                 "fp8": ((torch.float8_e4m3fn,), "torch.float8_e4m3fn")}
BIASES = ("gate_up_proj_bias", "down_proj_bias")


@dataclass(frozen=True)
class FusedExperts:
    """One MoE layer's fused expert tensors under `prefix`, in `layout` (module docstring)."""
    prefix: str
    layout: str
    has_bias: bool = False  # gpt-oss: gate_up_proj_bias, down_proj_bias
    fp8_block: tuple[int, int] | None = None  # GATE_UP_ROWS stored as FP8 with `*_scale_inv` blocks [bn, bk]

    def __post_init__(self):
        if self.fp8_block is not None and self.layout != GATE_UP_ROWS:
            raise ValueError(f"{self.prefix}: FP8 blocks apply to {GATE_UP_ROWS} experts, not {self.layout}")

    @property
    def source(self) -> SourceFormat | None:
        """The stored format the CPU experts hold as it is (MXFP4, block FP8), else None (float values)."""
        if self.layout == INTERLEAVED_MXFP4:
            return MXFP4_SOURCE
        return SourceFormat("fp8", self.fp8_block[1], "float32") if self.fp8_block is not None else None

    def names(self) -> tuple[str, ...]:
        """The tensors this layer's experts are read from, by their logical names (an FP8 form's `*_scale_inv` are
        parts of theirs: `Checkpoint.parts`)."""
        if self.layout == INTERLEAVED_MXFP4:
            suffixes = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")
        else:
            suffixes = ("gate_up_proj", "down_proj")
        return tuple(f"{self.prefix}.{s}" for s in suffixes + (BIASES if self.has_bias else ()))

    def expected(self, num_experts: int, hidden: int, inter: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """Stored name -> (shape, 'float', 'fp8' or 'uint8': `STORED_DTYPES`)."""
        e, gh, gi = num_experts, -(-hidden // 32), -(-inter // 32)
        shapes = {
            GATE_UP_ROWS: {"gate_up_proj": (e, 2 * inter, hidden), "down_proj": (e, hidden, inter)},
            INTERLEAVED: {"gate_up_proj": (e, hidden, 2 * inter), "down_proj": (e, inter, hidden)},
            INTERLEAVED_MXFP4: {"gate_up_proj_blocks": (e, 2 * inter, gh, 16),
                                "gate_up_proj_scales": (e, 2 * inter, gh),
                                "down_proj_blocks": (e, hidden, gi, 16), "down_proj_scales": (e, hidden, gi)},
        }[self.layout]
        kind = "uint8" if self.layout == INTERLEAVED_MXFP4 else "fp8" if self.fp8_block is not None else "float"
        out = {f"{self.prefix}.{s}": (shape, kind) for s, shape in shapes.items()}
        if self.has_bias:
            out |= {f"{self.prefix}.gate_up_proj_bias": ((e, 2 * inter), "float"),
                    f"{self.prefix}.down_proj_bias": ((e, hidden), "float")}
        return out

    def check(self, ckpt: Checkpoint, num_experts: int, hidden: int, inter: int) -> None:
        """Every stored tensor present with its shape and dtype, from the headers: one line naming the first that
        is not (an FP8 form's block scales too)."""
        for name, (shape, kind) in self.expected(num_experts, hidden, inter).items():
            if name not in ckpt.files:
                raise CheckpointError(f"{ckpt.directory}: fused expert tensor '{name}' is missing")
            info = ckpt.info(name)
            dtypes, want = STORED_DTYPES[kind]
            if tuple(info.shape) != shape or info.dtype not in dtypes:
                raise CheckpointError(f"{ckpt.file_of(name)}: fused expert tensor '{name}' is {info.dtype} "
                                      f"{tuple(info.shape)}, expected {want} {shape}")
            if kind == "fp8":
                ckpt.check_parts(name)  # its `_scale_inv` present, one block scale per expert and block

    def expert_parts(self, ckpt: Checkpoint, expert: int, spec: ExpertLayerSpec, is_passthrough: bool,
                     check: Check | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Expert `expert`'s entries of the expert file's tensors: (name, tensor) pairs, copied as stored
        (`is_passthrough`: MXFP4, block FP8) or quantized to `spec`; the biases (float32) where `spec.has_bias`.
        `check(stored name, tensor)` sees every value read first (NaN or inf)."""
        if is_passthrough:
            if self.source is None:
                raise ValueError(f"{self.prefix}: {self.layout} experts hold float values, nothing to copy as stored")
            stored = self._mxfp4 if self.layout == INTERLEAVED_MXFP4 else self._fp8
            yield from stored(ckpt, expert, spec, check).items()
        else:
            for role, weight in self.float_weights(ckpt, expert, spec, check).items():
                for part, tensor in quantize_matrix(weight, spec).items():
                    yield f"{role}.{part}", tensor
        if spec.has_bias:
            gate_up = self._row(ckpt, "gate_up_proj_bias", expert, check).float()  # [2I], interleaved
            yield "gate.bias", gate_up[0::2].contiguous()
            yield "up.bias", gate_up[1::2].contiguous()
            yield "down.bias", self._row(ckpt, "down_proj_bias", expert, check).float()

    def _row(self, ckpt: Checkpoint, suffix: str, expert: int, check: Check | None) -> torch.Tensor:
        name = f"{self.prefix}.{suffix}"
        row = ckpt.read_row(name, expert)
        if check is not None:
            check(name, row.view(torch.float8_e8m0fnu) if suffix.endswith("_scales") else row)
        return row

    def float_weights(self, ckpt: Checkpoint, expert: int, spec: ExpertLayerSpec, check: Check | None = None
                      ) -> dict[str, torch.Tensor]:
        """gate, up [I, H] and down [H, I] of one expert as float32 values (MXFP4, FP8 dequantized)."""
        if self.layout == INTERLEAVED_MXFP4:
            stored = self._mxfp4(ckpt, expert, spec, check)
            return {role: formats.dequantize_mxfp4(stored[f"{role}.weight"], stored[f"{role}.scales"],
                                                   spec.matrix_shape(role)[1]) for role in ("gate", "up", "down")}
        inter = spec.intermediate_size
        if self.fp8_block is not None:  # whole blocks dequantized, then split (gate and up may share a block)
            gate_up = self._fp8_matrix(ckpt, "gate_up_proj", expert, check).dequantize()
            down = self._fp8_matrix(ckpt, "down_proj", expert, check).dequantize()
        else:
            gate_up = self._row(ckpt, "gate_up_proj", expert, check).float()
            down = self._row(ckpt, "down_proj", expert, check).float()
        if self.layout == GATE_UP_ROWS:  # [2I, H], [H, I]
            return {"gate": gate_up[:inter], "up": gate_up[inter:], "down": down}
        return {"gate": gate_up[:, 0::2].T, "up": gate_up[:, 1::2].T, "down": down.T}  # [H, 2I], [I, H]

    def _mxfp4(self, ckpt: Checkpoint, expert: int, spec: ExpertLayerSpec, check: Check | None
               ) -> dict[str, torch.Tensor]:
        """One expert's MXFP4 codes and E8M0 scales as stored, the gate/up rows de-interleaved."""
        half_h, half_i = -(-spec.hidden_size // 2), -(-spec.intermediate_size // 2)
        gate_up = self._row(ckpt, "gate_up_proj_blocks", expert, check)  # [2I, H/32, 16]
        gate_up = gate_up.reshape(gate_up.shape[0], -1)[:, :half_h]
        scales = self._row(ckpt, "gate_up_proj_scales", expert, check)  # [2I, H/32]
        down = self._row(ckpt, "down_proj_blocks", expert, check)  # [H, I/32, 16]
        return {"gate.weight": gate_up[0::2].contiguous(), "gate.scales": scales[0::2].contiguous(),
                "up.weight": gate_up[1::2].contiguous(), "up.scales": scales[1::2].contiguous(),
                "down.weight": down.reshape(down.shape[0], -1)[:, :half_i].contiguous(),
                "down.scales": self._row(ckpt, "down_proj_scales", expert, check).contiguous()}

    def _fp8(self, ckpt: Checkpoint, expert: int, spec: ExpertLayerSpec, check: Check | None
             ) -> dict[str, torch.Tensor]:
        """One expert's FP8 codes and float32 scales as stored (the block scales repeated over their rows), the
        gate_up rows split."""
        inter = spec.intermediate_size
        gate_up = self._fp8_matrix(ckpt, "gate_up_proj", expert, check)  # [2I, H]
        down = self._fp8_matrix(ckpt, "down_proj", expert, check)  # [H, I]
        return {"gate.weight": gate_up.weight[:inter].contiguous(), "gate.scales": gate_up.scales[:inter].contiguous(),
                "up.weight": gate_up.weight[inter:].contiguous(), "up.scales": gate_up.scales[inter:].contiguous(),
                "down.weight": down.weight.contiguous(), "down.scales": down.scales.contiguous()}

    def _fp8_matrix(self, ckpt: Checkpoint, suffix: str, expert: int, check: Check | None) -> StoredMatrix:
        """Expert `expert`'s matrix of FP8 tensor `suffix` and its `_scale_inv` blocks, decoded (bits kept)."""
        block_rows, block_cols = self.fp8_block
        stored = {"weight": f"{self.prefix}.{suffix}", "weight_scale_inv": f"{self.prefix}.{suffix}{FP8_SCALE_SUFFIX}"}
        parts = {part: ckpt.read_row(name, expert) for part, name in stored.items()}
        layout = Layout("deepseek-fp8", "fp8", block_cols, "float32", block_rows)
        try:
            return decode(parts, layout, None, check and (lambda part, tensor: check(stored[part], tensor)))
        except PartError as exc:
            raise CheckpointError(f"{ckpt.file_of(stored[exc.part])}: '{stored[exc.part]}' of expert {expert} "
                                  f"{exc.detail}") from None


def fused_experts(model, ckpt: Checkpoint, layer: int) -> FusedExperts | None:
    """MoE layer `layer`'s fused expert storage in `ckpt`, or None where the checkpoint stores one tensor per expert
    and projection. gpt-oss says so with `fused_experts_prefix(layer)` (its MXFP4 form found by `*_blocks`),
    Qwen3.5 with `MoEConfig.has_fused_storage` (its FP8 form found by float8 `gate_up_proj` in a block-FP8
    checkpoint)."""
    if hasattr(model, "fused_experts_prefix"):
        prefix = model.fused_experts_prefix(layer)
        layout = INTERLEAVED_MXFP4 if f"{prefix}.gate_up_proj_blocks" in ckpt.files else INTERLEAVED
        return FusedExperts(prefix, layout, getattr(model, "has_expert_bias", False))
    if model.config.moe.has_fused_storage:
        prefix = f"model.layers.{layer}.{model.ff_name}.experts"
        name = f"{prefix}.gate_up_proj"
        is_fp8 = ckpt.fp8_block is not None and name in ckpt.files and ckpt.info(name).dtype == torch.float8_e4m3fn
        return FusedExperts(prefix, GATE_UP_ROWS, fp8_block=ckpt.fp8_block if is_fp8 else None)
    return None


def fused_source(layers: list[FusedExperts]) -> SourceFormat | None:
    """The stored format of every one of `layers`, where they share one the CPU experts hold as it is."""
    sources = {fused.source for fused in layers}
    return sources.pop() if len(sources) == 1 else None


def read_fused_layer(ckpt: Checkpoint, fused: FusedExperts, spec: ExpertLayerSpec, is_passthrough: bool,
                     check: Check | None = None, num_threads: int = 1) -> dict[str, torch.Tensor]:
    """One layer's fused experts as the expert file's stacked tensors, `num_threads` experts at a time."""
    tensors = {name: memory.empty_tensor(shape, dtype) for name, (shape, dtype) in spec.tensor_shapes().items()}

    def one_expert(expert: int) -> None:
        for name, tensor in fused.expert_parts(ckpt, expert, spec, is_passthrough, check):
            tensors[name][expert].copy_(tensor)

    for_each_expert(one_expert, spec.num_experts, num_threads)
    return tensors
