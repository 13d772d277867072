"""A checkpoint's routed experts read into the expert file's stacked tensors (`cpu_experts.expert_file`: `gate.weight`,
`gate.scales`, ..., NVFP4's `gate.tensor_scale`), shared by the converter (`convert.units`) and the runtime that
serves a checkpoint directory without converting it (`hybrid.direct_experts`).

Experts the checkpoint stores in a format the CPU experts hold (FP8 e4m3 with block or channel scales, MXFP4, NVFP4,
compressed-tensors INT4: the layouts of `hybrid.stored_matrix`) are copied as stored, bit for bit (the scales
widened exactly where the expert file keeps them wider); others are quantized from their values (`quantize_matrix`).
Which of the two happens is `resolve`'s: the expert dtype asked for (`auto`: the source's own format where it has
one, else int8), and whether the source's format is that one.

gpt-oss keeps its experts fused and MXFP4 (`mlp.experts.gate_up_proj_blocks` [E, 2I, H/32, 16] with gate and up
interleaved along the rows, `*_scales` E8M0 [E, 2I, H/32], `down_proj_blocks` [E, H, I/32, 16], `down_proj_scales`):
`read_gpt_oss_layer` reads one layer of them, as stored where the expert dtype is MXFP4, else quantized from their
values (or from a bf16 checkpoint's fused `gate_up_proj` [E, H, 2I] / `down_proj` [E, I, H]), with their biases
(`gate_up_proj_bias` de-interleaved, `down_proj_bias`) as the expert file's float32 `*.bias`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from cpu_experts import memory
from cpu_experts.expert_file import (
    ALLOWED_SCALES,
    FIXED_GROUP,
    ROLES,
    ExpertLayerSpec,
    dequantize_matrix,
    quantize_matrix,
)
from hybrid.checkpoint import FP8_SCALE_SUFFIX, Checkpoint
from hybrid.errors import CheckpointError, ConfigError
from hybrid.stored_matrix import Layout, PartError, StoredMatrix, decode

# the group a format is quantized to when nothing else says (int8: one scale per output channel)
DEFAULT_GROUPS = {"int8": 0, "int4": 128, "fp8": 128, "bf16": 0} | FIXED_GROUP
INT4_GROUP_MULTIPLE = 32  # the int4 kernels' vectors hold whole groups
CHUNK_ROWS = 256  # rows of one projection quantized at a time (DeepSeek-V3 gate: 256 x 7168 float32 = 7 MiB)
GPT_OSS_SUFFIXES = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")

Check = Callable[[str, torch.Tensor], object]  # (stored tensor name, tensor) -> raises when it holds NaN or inf


@dataclass(frozen=True)
class SourceFormat:
    """The format every routed expert of a checkpoint is stored in (see `source_format`)."""
    dtype: str
    group_size: int
    scale_dtype: str

    @property
    def title(self) -> str:
        return self.dtype.upper()


@dataclass(frozen=True)
class ExpertFormat:
    dtype: str  # one of cpu_experts.expert_file.EXPERT_DTYPES
    group_size: int  # 0: one scale per output channel
    scale_dtype: str = "float32"
    source: SourceFormat | None = None  # the source's own expert format, where it has one

    @property
    def is_passthrough(self) -> bool:
        """The source's experts are copied as stored, not quantized."""
        source = self.source
        return source is not None and (self.dtype, self.group_size, self.scale_dtype) == \
            (source.dtype, source.group_size, source.scale_dtype)

    def spec(self, config) -> ExpertLayerSpec:
        return ExpertLayerSpec(config.moe.num_experts, config.hidden_size, config.moe.intermediate_size, self.dtype,
                               self.group_size, self.scale_dtype)

    def note(self, fix: str = "--expert-dtype auto") -> str | None:
        """One line for the user where the source's own quantized experts are concerned: copied, or rounded again."""
        source = self.source
        if source is None:
            return None
        if self.is_passthrough:
            return (f"experts: the source's {source.title} (group {source.group_size}, {source.scale_dtype} scales) "
                    "copied as stored, no re-quantization")
        what = f"{self.dtype} group {self.group_size}" if self.group_size else self.dtype
        return (f"experts: the source's {source.title} (group {source.group_size}) re-quantized to {what} from its "
                f"dequantized weights, a second rounding; {fix} copies it as stored")


def routed_names(model) -> list[tuple[int, int, str, str]]:
    """(layer, expert, role, checkpoint name) of every routed expert projection of `model`."""
    config = model.config
    return [(layer, e, role, model.routed_expert_name(layer, e, role)) for layer in config.moe_layer_indices
            for e in range(config.moe.num_experts) for role in ROLES]


def source_format(ckpt: Checkpoint, names: list[str]) -> SourceFormat | None:
    """The format all of `names` (routed expert projections) are stored in, when the CPU experts hold it as it is
    (one dtype and group for all, int4 groups a multiple of 32); None otherwise (float experts, mixed formats)."""
    layouts = [ckpt.layout(name) for name in names]
    if not layouts or any(layout is None for layout in layouts):
        return None
    kinds = {(layout.dtype, layout.group_size) for layout in layouts}
    if len(kinds) != 1:
        return None
    dtype, group = kinds.pop()
    if dtype == "int4" and group % INT4_GROUP_MULTIPLE:
        return None
    scale_dtypes = {layout.scale_dtype for layout in layouts}
    return SourceFormat(dtype, group, scale_dtypes.pop() if len(scale_dtypes) == 1 else "float32")


def resolve(source: SourceFormat | None, dtype: str, group_size: int | None = None,
            flag: str = "--group-size") -> ExpertFormat:
    """The expert format for `dtype` ("auto": the source's own format, int8 for a float source) and `group_size`
    (None: the source's where it is copied, else `DEFAULT_GROUPS`)."""
    if dtype == "auto":
        dtype = source.dtype if source is not None else "int8"
    if dtype == "bf16":
        return ExpertFormat("bf16", 0, source=source)
    fixed = FIXED_GROUP.get(dtype)
    if fixed is not None and group_size not in (None, fixed):
        raise ConfigError(f"{flag} {group_size} does not apply to {dtype} experts (their group is {fixed}); drop it")
    if source is not None and dtype == source.dtype and group_size in (None, source.group_size):
        return ExpertFormat(dtype, source.group_size, source.scale_dtype, source)
    group = group_size if group_size is not None else DEFAULT_GROUPS[dtype]
    return ExpertFormat(dtype, group, ALLOWED_SCALES[dtype][0], source)  # the quantizer's own scale dtype


def projection_parts(ckpt: Checkpoint, name: str, role: str, spec: ExpertLayerSpec, is_passthrough: bool,
                     check: Check | None = None) -> Iterator[tuple[str, torch.Tensor, int]]:
    """Source projection `name` in the expert file's layout: (part, tensor, first row) pieces (`weight`, `scales`,
    `tensor_scale`), copied as stored or quantized CHUNK_ROWS rows at a time (NVFP4, whose tensor scale spans the
    projection, at once). `check(stored name, tensor)` sees what could hold NaN or inf first."""
    rows, cols = spec.matrix_shape(role)
    if is_passthrough:
        matrix = ckpt.read_matrix(name, ckpt.layout(name), (rows, cols), check)
        scales = matrix.scales.float() if spec.scale_dtype == "float32" else matrix.scales  # bf16 widens exactly
        if matrix.layout.group_size != spec.group(cols):
            raise CheckpointError(f"{ckpt.file_of(name)}: '{name}' is stored in groups of "
                                  f"{matrix.layout.group_size}, the other experts in groups of {spec.group_size}")
        yield "weight", matrix.weight, 0
        yield "scales", scales.contiguous(), 0
        if matrix.tensor_scale is not None:
            yield "tensor_scale", matrix.tensor_scale, 0
        return
    weight = ckpt.read(name)
    if check is not None and (spec.dtype == "bf16" or spec.scale_dtype != "float32"):
        check(name, weight)  # no float32 scale to show a NaN (bf16 keeps the values; FP4 scales are 8-bit codes)
    step = rows if spec.dtype == "nvfp4" else CHUNK_ROWS
    for first in range(0, rows, step):
        parts = quantize_matrix(weight[first:first + step], spec)
        if check is not None and "scales" in parts and spec.scale_dtype == "float32":
            check(name, parts["scales"])  # a group's scale is its largest magnitude: NaN or inf where the group is
        for part, tensor in parts.items():
            yield part, tensor, first


def fused_fp8_source(ckpt: Checkpoint, prefix: str) -> SourceFormat | None:
    """FP8 where the checkpoint stores a layer's fused 3-D experts under `prefix` as float8 with block scales
    (transformers' FP8 experts: `gate_up_proj` [E, 2I, H] and `gate_up_proj_scale_inv` [E, ceil(2I / bn),
    ceil(H / bk)] float32, `down_proj` [E, H, I] and `down_proj_scale_inv` likewise, blocks
    `quantization_config.weight_block_size`), else None (float experts)."""
    name = f"{prefix}.gate_up_proj"
    if ckpt.fp8_block is None or name not in ckpt.files or ckpt.info(name).dtype != torch.float8_e4m3fn:
        return None
    return SourceFormat("fp8", ckpt.fp8_block[1], "float32")


def read_fused_layer(ckpt: Checkpoint, prefix: str, spec: ExpertLayerSpec, check: Check | None = None,
                     num_threads: int = 1) -> dict[str, torch.Tensor]:
    """One layer of experts stored as fused 3-D tensors under `prefix` (Qwen3.5: `gate_up_proj` [E, 2I, H], gate
    rows first, `down_proj` [E, H, I]; float, or FP8 with block scales: `fused_fp8_source`) -> the expert file's
    stacked tensors, expert by expert, each expert's rows read alone (a layer's bf16 experts are gigabytes),
    `num_threads` experts at a time. FP8 experts are copied as stored where `spec` is their FP8 format (the block
    scales repeated over their rows, so gate and up may split a block), else dequantized and quantized to `spec`;
    float ones are quantized to `spec`."""
    names = {"gate_up": f"{prefix}.gate_up_proj", "down": f"{prefix}.down_proj"}
    inter = spec.intermediate_size
    expected = {"gate_up": (spec.num_experts, 2 * inter, spec.hidden_size),
                "down": (spec.num_experts, spec.hidden_size, inter)}
    for key, name in names.items():
        if name not in ckpt.files:
            raise CheckpointError(f"{ckpt.directory}: fused expert tensor '{name}' is missing")
        if tuple(ckpt.info(name).shape) != expected[key]:
            raise CheckpointError(f"{ckpt.file_of(name)}: '{name}' has shape {tuple(ckpt.info(name).shape)}, "
                                  f"expected {expected[key]}")
    source = fused_fp8_source(ckpt, prefix)
    is_passthrough = source is not None and (spec.dtype, spec.group_size, spec.scale_dtype) == \
        (source.dtype, source.group_size, source.scale_dtype)
    tensors = {name: memory.empty_tensor(shape, dtype) for name, (shape, dtype) in spec.tensor_shapes().items()}
    rows = {"gate": ("gate_up", slice(0, inter)), "up": ("gate_up", slice(inter, 2 * inter)),
            "down": ("down", slice(None))}

    def one_expert(expert: int) -> None:
        if source is not None:
            stored = {key: _fused_fp8_matrix(ckpt, name, expert, check) for key, name in names.items()}
            for role, (key, part) in rows.items():
                if is_passthrough:
                    tensors[f"{role}.weight"][expert].copy_(stored[key].weight[part])
                    tensors[f"{role}.scales"][expert].copy_(stored[key].scales[part])
                    continue
                for name, tensor in quantize_matrix(stored[key].dequantize()[part], spec).items():
                    tensors[f"{role}.{name}"][expert].copy_(tensor)
            return
        weights = {key: ckpt.read_row(name, expert) for key, name in names.items()}  # [2I, H], [H, I]
        for key, name in names.items():
            _check(check, name, weights[key])
        for role, (key, part) in rows.items():
            for name, tensor in quantize_matrix(weights[key][part].float(), spec).items():
                tensors[f"{role}.{name}"][expert].copy_(tensor)

    for_each_expert(one_expert, spec.num_experts, num_threads)
    return tensors


def _fused_fp8_matrix(ckpt: Checkpoint, name: str, expert: int, check: Check | None) -> StoredMatrix:
    """Expert `expert`'s matrix of fused FP8 tensor `name` and its `_scale_inv` blocks, decoded (bits kept; the
    block scales repeated over their rows)."""
    block_rows, block_cols = ckpt.fp8_block
    scale_name = name + FP8_SCALE_SUFFIX
    if scale_name not in ckpt.files:
        raise CheckpointError(f"{ckpt.file_of(name)}: FP8 expert tensor '{name}' has no '{scale_name}'")
    parts = {"weight": ckpt.read_row(name, expert), "weight_scale_inv": ckpt.read_row(scale_name, expert)}
    stored = {"weight": name, "weight_scale_inv": scale_name}
    layout = Layout("deepseek-fp8", "fp8", block_cols, "float32", block_rows)
    try:
        return decode(parts, layout, None, check and (lambda part, tensor: check(stored[part], tensor)))
    except PartError as exc:
        raise CheckpointError(f"{ckpt.file_of(stored[exc.part])}: '{stored[exc.part]}' of expert {expert} "
                              f"{exc.detail}") from None


def for_each_expert(fill: Callable[[int], None], num_experts: int, num_threads: int) -> None:
    """fill(expert) for every expert, `num_threads` at a time (torch's ops release the GIL); a worker's error is
    raised here."""
    if num_threads == 1:
        for expert in range(num_experts):
            fill(expert)
        return
    with ThreadPoolExecutor(min(num_threads, num_experts)) as pool:
        list(pool.map(fill, range(num_experts)))  # list(): re-raises a worker's error


def gpt_oss_source(ckpt: Checkpoint, prefix: str) -> SourceFormat | None:
    """MXFP4 where the checkpoint stores gpt-oss's experts as published (`*_blocks` under `prefix`), else None."""
    return SourceFormat("mxfp4", 32, "e8m0") if f"{prefix}.gate_up_proj_blocks" in ckpt.files else None


def read_gpt_oss_layer(ckpt: Checkpoint, prefix: str, spec: ExpertLayerSpec,
                       check: Check | None = None) -> dict[str, torch.Tensor]:
    """One layer of gpt-oss's fused experts under `prefix` (`model.layers.N.mlp.experts`) -> the expert file's
    stacked tensors: MXFP4 as stored where both are MXFP4, else quantized to `spec` from the weights' values; plus
    the biases where `spec.has_bias`."""
    if gpt_oss_source(ckpt, prefix) is not None and spec.dtype == "mxfp4":
        tensors = _gpt_oss_mxfp4(ckpt, prefix, spec, check)
    else:
        tensors = _gpt_oss_quantized(ckpt, prefix, spec, check)
    if spec.has_bias:
        gate_up_bias = ckpt.read(f"{prefix}.gate_up_proj_bias").float()
        down_bias = ckpt.read(f"{prefix}.down_proj_bias").float()
        _check(check, f"{prefix}.gate_up_proj_bias", gate_up_bias)
        _check(check, f"{prefix}.down_proj_bias", down_bias)
        tensors |= {"gate.bias": gate_up_bias[:, 0::2].contiguous(), "up.bias": gate_up_bias[:, 1::2].contiguous(),
                    "down.bias": down_bias.contiguous()}
    return tensors


def _gpt_oss_quantized(ckpt: Checkpoint, prefix: str, spec: ExpertLayerSpec, check: Check | None
                       ) -> dict[str, torch.Tensor]:
    """gate, up [E, I, H] and down [E, H, I] as float values (a bf16 checkpoint's `gate_up_proj` [E, H, 2I] and
    `down_proj` [E, I, H] transposed, or published MXFP4 dequantized), quantized expert by expert to `spec`."""
    e = spec.num_experts
    if gpt_oss_source(ckpt, prefix) is not None:
        mx = replace(spec, dtype="mxfp4", group_size=32, scale_dtype="e8m0", has_bias=False)
        stored = _gpt_oss_mxfp4(ckpt, prefix, mx, check)
        weights = {role: torch.stack([dequantize_matrix(stored[f"{role}.weight"][x], stored[f"{role}.scales"][x],
                                                        role, mx) for x in range(e)]) for role in ROLES}
    else:
        gate_up = ckpt.read(f"{prefix}.gate_up_proj")
        down = ckpt.read(f"{prefix}.down_proj")
        _check(check, f"{prefix}.gate_up_proj", gate_up)
        _check(check, f"{prefix}.down_proj", down)
        weights = {"gate": gate_up[..., 0::2].transpose(1, 2), "up": gate_up[..., 1::2].transpose(1, 2),
                   "down": down.transpose(1, 2)}
    quantized: dict[str, list[torch.Tensor]] = {}
    for role in ROLES:
        if tuple(weights[role].shape) != (e, *spec.matrix_shape(role)):
            raise CheckpointError(f"{ckpt.directory}: gpt-oss experts under '{prefix}' give {role} "
                                  f"{tuple(weights[role].shape)}, expected {(e, *spec.matrix_shape(role))}")
        for x in range(e):
            for part, tensor in quantize_matrix(weights[role][x], spec).items():
                quantized.setdefault(f"{role}.{part}", []).append(tensor)
    return {name: torch.stack(parts) for name, parts in quantized.items()}


def _gpt_oss_mxfp4(ckpt: Checkpoint, prefix: str, spec: ExpertLayerSpec, check: Check | None
                   ) -> dict[str, torch.Tensor]:
    """The published MXFP4 experts as stored: the packed codes reshaped (32 columns are 16 bytes, even column in the
    low nibble, as `cpu_experts.formats`), the gate/up rows de-interleaved (gate = rows 0::2, up = rows 1::2)."""
    e, hidden, inter = spec.num_experts, spec.hidden_size, spec.intermediate_size
    expected = {"gate_up_proj_blocks": (e, 2 * inter, -(-hidden // 32), 16),
                "gate_up_proj_scales": (e, 2 * inter, -(-hidden // 32)),
                "down_proj_blocks": (e, hidden, -(-inter // 32), 16), "down_proj_scales": (e, hidden, -(-inter // 32))}
    stored = {}
    for suffix, shape in expected.items():
        name = f"{prefix}.{suffix}"
        if name not in ckpt.files:
            raise CheckpointError(f"{ckpt.directory}: gpt-oss expert tensor '{name}' is missing")
        info = ckpt.info(name)
        if tuple(info.shape) != shape or info.dtype != torch.uint8:
            raise CheckpointError(f"{ckpt.file_of(name)}: '{name}' is {info.dtype} {tuple(info.shape)}, expected "
                                  f"torch.uint8 {shape}")
        stored[suffix] = ckpt.read_raw(name)
        if suffix.endswith("_scales"):
            _check(check, name, stored[suffix].view(torch.float8_e8m0fnu))
    gate_up = stored["gate_up_proj_blocks"].reshape(e, 2 * inter, -1)[..., : -(-hidden // 2)]
    scales = stored["gate_up_proj_scales"]
    return {"gate.weight": gate_up[:, 0::2].contiguous(), "gate.scales": scales[:, 0::2].contiguous(),
            "up.weight": gate_up[:, 1::2].contiguous(), "up.scales": scales[:, 1::2].contiguous(),
            "down.weight": stored["down_proj_blocks"].reshape(e, hidden, -1)[..., : -(-inter // 2)].contiguous(),
            "down.scales": stored["down_proj_scales"].contiguous()}


def _check(check: Check | None, name: str, tensor: torch.Tensor) -> None:
    if check is not None:
        check(name, tensor)
