"""A checkpoint's routed experts read into the expert file's stacked tensors (`cpu_experts.expert_file`: `gate.weight`,
`gate.scales`, ..., NVFP4's `gate.tensor_scale`), shared by the converter (`convert.units`) and the runtime that
serves a checkpoint directory without converting it (`hybrid.direct_experts`).

Experts the checkpoint stores in a format the CPU experts hold (FP8 e4m3 with block or channel scales, MXFP4, NVFP4,
compressed-tensors INT4: the layouts of `hybrid.stored_matrix`) are copied as stored, bit for bit (the scales
widened exactly where the expert file keeps them wider); others are quantized from their values (`quantize_matrix`).
Which of the two happens is `resolve`'s: the expert dtype asked for (`auto`: the source's own format where it has
one, else int8), and whether the source's format is that one.

Experts stored fused per layer (gpt-oss, Qwen3.5) have their readers in `hybrid.fused_experts`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from cpu_experts.expert_file import (
    ALLOWED_SCALES,
    FIXED_GROUP,
    ROLES,
    ExpertLayerSpec,
    quantize_matrix,
)
from hybrid.checkpoint import Checkpoint
from hybrid.errors import CheckpointError, ConfigError

# the group a format is quantized to when nothing else says (int8: one scale per output channel)
DEFAULT_GROUPS = {"int8": 0, "int4": 128, "fp8": 128, "bf16": 0} | FIXED_GROUP
INT4_GROUP_MULTIPLE = 32  # the int4 kernels' vectors hold whole groups
CHUNK_ROWS = 256  # rows of one projection quantized at a time (DeepSeek-V3 gate: 256 x 7168 float32 = 7 MiB)

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

    def model_spec(self, model) -> ExpertLayerSpec:
        """`spec` of `model`'s layers, with the model's own expert activation and biases where it has them
        (gpt-oss: `expert_activation`, `has_expert_bias`)."""
        spec = self.spec(model.config)
        if hasattr(model, "expert_activation"):
            spec = replace(spec, activation=model.expert_activation, has_bias=model.has_expert_bias)
        return spec

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


def for_each_expert(fill: Callable[[int], None], num_experts: int, num_threads: int) -> None:
    """fill(expert) for every expert, `num_threads` at a time (torch's ops release the GIL); a worker's error is
    raised here."""
    if num_threads == 1:
        for expert in range(num_experts):
            fill(expert)
        return
    with ThreadPoolExecutor(min(num_threads, num_experts)) as pool:
        list(pool.map(fill, range(num_experts)))  # list(): re-raises a worker's error
