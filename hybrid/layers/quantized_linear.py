"""Dense Linear layers that keep their checkpoint's quantized weights and multiply through the Triton GEMMs of
`gpu_layers.linear`, instead of holding a weight dequantized at load time.

Data flow:
- Placement (once, before loading; `place_quantized_linears`): for every plain `nn.Linear` whose checkpoint
  weight is stored as several parts, the parts' headers (suffix -> shape, dtype) are matched against `FORMATS`:
    DeepSeek FP8      `weight` float8_e4m3fn [N, K] + `weight_scale_inv` [ceil(N / bn), ceil(K / bk)]
                      -> fp8_linear(x, weight, weight_scale_inv, block_shape=(bn, bk))
    compressed FP8    `weight` float8_e4m3fn [N, K] + `weight_scale` [N, 1] -> fp8_linear(x, weight, weight_scale)
    compressed W4A16  `weight_packed` int32 [N, ceil(K / 8)] + `weight_scale` [N, ceil(K / g)] + `weight_shape`
                      -> w4a16_linear(x, weight_packed, weight_scale, g)
  Where the format, the Linear's shape and the kernel's requirements all fit, the Linear is replaced by a
  `QuantizedLinear` holding one buffer per stored part, named like it; anything else keeps the plain Linear (and
  the loader's dequantize-at-load path). Only the Triton ops in bf16/fp16 ask for this (`Backends`).
- Loading: the loader hands `load_parts` the stored tensors as read (suffix -> tensor): a plain copy per buffer
  (scales converted to the dtype the kernel takes).
- forward(x [..., K] bf16/fp16) -> [..., N] in x's dtype, through the kernel chosen at placement.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

FP8_K_MULTIPLE = 16  # fp8_linear reads 16-byte-aligned fp8 rows
W4A16_K_MULTIPLE = 32  # w4a16_linear: K and every group a multiple of its smallest K tile
FP8_BLOCK_K_MULTIPLE = 128  # fp8_linear's block-scaled K tiles (64 or 128 wide) must divide a scale block's columns

HALF_DTYPES = (torch.bfloat16, torch.float16)  # the activation dtypes the kernels take
PartSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]  # buffer (stored suffix) -> (shape, dtype) to allocate


class MatrixLinear(nn.Linear):
    """A Linear whose weight other code reads as a matrix (MLA's kv_b_proj feeds the attention kernels), so it always
    holds the dequantized weight and is never replaced by a `QuantizedLinear`."""


class QuantizedLinear(nn.Module):
    """y = x @ W^T (+ bias), W kept as the checkpoint stores it; `kernel(x2d, *buffers named by kernel_args)`."""

    def __init__(self, in_features: int, out_features: int, parts: PartSpec, kernel: Callable,
                 kernel_args: tuple[str, ...], bias: torch.Tensor | None, device: torch.device):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        for name, (shape, dtype) in parts.items():
            self.register_buffer(name, torch.empty(shape, dtype=dtype, device=device))
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.kernel, self.kernel_args = kernel, kernel_args

    @property
    def shape(self) -> tuple[int, int]:
        """The logical weight's shape [N, K]: what the loader checks the checkpoint's `X.weight` against."""
        return self.out_features, self.in_features

    def checkpoint_targets(self):
        """The logical `weight` is this module (it takes the stored parts, `load_parts`); the bias a plain copy."""
        yield "weight", self
        if self.bias is not None:
            yield "bias", self.bias.data

    def load_parts(self, parts: dict[str, torch.Tensor]) -> None:
        """Copies each stored part (suffix -> tensor, as read) into the buffer of the same name."""
        if set(parts) != set(self._buffers):
            raise ValueError(f"stored parts {sorted(parts)} are not the expected {sorted(self._buffers)}")
        with torch.no_grad():
            for name, tensor in parts.items():
                buffer = self._buffers[name]
                if tuple(tensor.shape) != tuple(buffer.shape):
                    raise ValueError(f"'{name}' has shape {tuple(tensor.shape)}, expected {tuple(buffer.shape)}")
                buffer.copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The kernels take [T, K] with contiguous rows; a no-op for the layers' usual contiguous inputs.
        x2d = x.reshape(-1, self.in_features).contiguous()
        y = self.kernel(x2d, *(self._buffers[n] for n in self.kernel_args), bias=self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kernel = getattr(self.kernel, "func", self.kernel)
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={kernel.__name__}"


def _fp8_block(infos, n: int, k: int, dtype: torch.dtype, fp8_block, group_size, read_part):
    weight, scale = infos["weight"], infos["weight_scale_inv"]
    if fp8_block is None or weight.dtype != torch.float8_e4m3fn or k % FP8_K_MULTIPLE:
        return None
    if fp8_block[1] % FP8_BLOCK_K_MULTIPLE or tuple(scale.shape) != (-(-n // fp8_block[0]), -(-k // fp8_block[1])):
        return None
    parts = {"weight": ((n, k), weight.dtype), "weight_scale_inv": (tuple(scale.shape), torch.float32)}
    return parts, ("weight", "weight_scale_inv"), dict(block_shape=tuple(fp8_block))


def _fp8_channel(infos, n: int, k: int, dtype: torch.dtype, fp8_block, group_size, read_part):
    weight, scale = infos["weight"], infos["weight_scale"]
    if weight.dtype != torch.float8_e4m3fn or k % FP8_K_MULTIPLE or tuple(scale.shape) not in ((n, 1), (n,)):
        return None
    # float32 scales: the kernel would otherwise convert them on every call
    parts = {"weight": ((n, k), weight.dtype), "weight_scale": (tuple(scale.shape), torch.float32)}
    return parts, ("weight", "weight_scale"), {}


def _w4a16(infos, n: int, k: int, dtype: torch.dtype, fp8_block, group_size, read_part):
    packed, scale, shape = infos["weight_packed"], infos["weight_scale"], infos["weight_shape"]
    group = group_size or k
    num_groups = -(-k // group)
    if packed.dtype != torch.int32 or tuple(packed.shape) != (n, -(-k // 8)) or tuple(shape.shape) != (2,):
        return None
    if k % W4A16_K_MULTIPLE or (num_groups > 1 and group % W4A16_K_MULTIPLE) or tuple(scale.shape) != (n, num_groups):
        return None
    if tuple(read_part("weight_shape").tolist()) != (n, k):  # the packed rows alone leave K up to 7 columns open
        return None
    # scales in the activations' dtype, as the kernel takes them
    parts = {"weight_packed": ((n, -(-k // 8)), torch.int32), "weight_scale": ((n, num_groups), dtype),
             "weight_shape": (tuple(shape.shape), shape.dtype)}
    return parts, ("weight_packed", "weight_scale"), dict(group_size=group_size)


# The stored suffixes of one logical weight -> (format name, its planner); a planner returns None where the shapes
# or dtypes are not ones the kernel takes.
FORMATS = {
    frozenset({"weight", "weight_scale_inv"}): ("fp8_linear", _fp8_block),
    frozenset({"weight", "weight_scale"}): ("fp8_linear", _fp8_channel),
    frozenset({"weight_packed", "weight_scale", "weight_shape"}): ("w4a16_linear", _w4a16),
}


def quantized_linear_for(linear: nn.Linear, infos: dict, fp8_block, group_size, read_part) -> QuantizedLinear | None:
    """The `QuantizedLinear` replacing `linear` for a weight stored as `infos` (suffix -> header with .shape and
    .dtype); None where the format or its shapes are not ones the kernels take."""
    entry = FORMATS.get(frozenset(infos))
    if entry is None:
        return None
    kernel_name, planner = entry
    n, k = linear.out_features, linear.in_features
    plan = planner(infos, n, k, linear.weight.dtype, fp8_block, group_size, read_part)
    if plan is None:
        return None
    parts, kernel_args, kwargs = plan
    from gpu_layers import linear as kernels  # only the GPU path imports Triton

    bias = None if linear.bias is None else linear.bias.data
    return QuantizedLinear(k, n, parts, partial(getattr(kernels, kernel_name), **kwargs), kernel_args, bias,
                           linear.weight.device)


def place_quantized_linears(model: nn.Module, ckpt) -> list[str]:
    """Replaces every plain Linear of `model` whose checkpoint weight (`ckpt`, a `hybrid.checkpoint.Checkpoint`) is
    stored quantized in a form the kernels take by a `QuantizedLinear`; returns the replaced modules' names."""
    modules = dict(model.named_modules())
    group_size = ckpt.compressed.group_size if ckpt.compressed is not None else None
    placed = []
    for name, stored in ckpt.parts.items():
        module_name = name.removesuffix(".weight")
        linear = modules.get(module_name)
        # exactly nn.Linear: not MatrixLinear, whose weight is read as a matrix; the kernels take 16-bit activations
        if len(stored) < 2 or type(linear) is not nn.Linear or linear.weight.dtype not in HALF_DTYPES:
            continue
        infos = ckpt.part_infos(name)
        replacement = quantized_linear_for(linear, infos, ckpt.fp8_block, group_size,
                                           lambda suffix, m=module_name: ckpt.read_raw(f"{m}.{suffix}"))
        if replacement is not None:
            parent, _, attr = module_name.rpartition(".")
            setattr(modules[parent], attr, replacement)
            placed.append(module_name)
    return placed
