"""Expert layers built as checkpoints store them and read by the checkpoint readers (`hybrid.stored_matrix`), for the
CPU operator tests: FP8 with 128 x 128 block scales (DeepSeek's float32 `weight_scale_inv`, DeepSeek-V4's E8M0
`.scale`) of any shape, partial last blocks included, and layers whose E8M0 scales sit at the format's extremes
(0: 2^-127, 254: 2^127) for FP8 and MXFP4, with tokens whose activations keep every path's products normal floats.

Each layer comes with its float32 reference weights computed here from the stored bits (float64 products rounded
once), independent of the readers and of `cpu_experts.formats`.

Extreme scales: bf16 activations cannot offset 2^127 and 2^-127 in one dot (their range is 2^-133 .. 2^128), and
AMX-BF16 flushes products and sums below 2^-126 (README's numerics contract). So the experts come in three classes
and each token is routed within one class, with activations sized for it:
- "big": gate/up scales 254 (and 250-253), down scales 0 (and 1-4); tokens' activations about 2^-110, so that every
  product of a weight code (2^-9 at least) and an activation, and every partial sum of them, is a normal float;
  codes under scales from 250 up are those whose value times the scale stays finite (below 2);
- "small": the other way round (gate/up near 2^-127, activations about 2^100, down near 2^127);
- "plain": scales 120-134, activations about 1.
A token's output then lies far from another class's (2^-75, 2^100, 1): compare them scaled by `per_token_scale`.
"""

from __future__ import annotations

import torch

from cpu_experts import formats
from cpu_experts.expert_file import ROLES, ExpertLayerSpec
from hybrid import stored_matrix
from hybrid.safetensors_io import TensorInfo

BLOCK = 128  # DeepSeek's FP8 block, rows and columns
SCALE_PARTS = {"weight_scale_inv": "deepseek-fp8", "scale": "e8m0-fp8"}  # stored scale part -> reader layout
CLASSES = ("big", "small", "plain")
CLASS_EXPERTS = 8  # experts per class: expert e is of class CLASSES[e // CLASS_EXPERTS]
X_EXPONENT = {"big": -110, "small": 100, "plain": 0}
HIGH, LOW, PLAIN = (250, 254), (0, 4), (120, 134)  # E8M0 ranges (inclusive); the first of HIGH/LOW's is rarer
FP8_BELOW_2 = 0xBF  # clears e4m3's top exponent bit: |value| <= 1.875
E2M1_BELOW_2 = 0b1011  # clears e2m1's top exponent bit: |value| <= 1.5


def read(parts: dict[str, torch.Tensor], shape: tuple[int, int]) -> stored_matrix.StoredMatrix:
    """One matrix's stored parts through the checkpoint reader: layout identified from the headers, then decoded."""
    infos = {name: TensorInfo(t.dtype, tuple(t.shape), 0, t.numel() * t.element_size()) for name, t in parts.items()}
    layout = stored_matrix.identify(infos, (BLOCK, BLOCK), None)
    assert layout is not None, {name: info.dtype for name, info in infos.items()}
    return stored_matrix.decode(parts, layout, shape)


def _expand(block_scales: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[ceil(N / 128), ceil(K / 128)] -> [N, K], the last blocks cut to the matrix."""
    return block_scales.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]


def block_fp8_layer(num_experts: int, hidden: int, inter: int, codes, scales, scale_part: str):
    """FP8 experts stored with 128 x 128 block scales: scales(role, e, (ceil(N / 128), ceil(K / 128))) -> float32
    `weight_scale_inv` values or uint8 E8M0 bits (`scale_part`), then codes(role, e, (N, K)) -> uint8 e4m3 bits (asked
    for after the matrix's scales, which they may depend on). Returns the expert file's tensors as the readers give
    them (`PackedLayer.from_file_tensors`), their spec and the reference gate, up [E, I, H], down [E, H, I]
    (float32)."""
    spec = ExpertLayerSpec(num_experts, hidden, inter, "fp8", BLOCK)
    tensors, reference = {}, []
    for role in ROLES:
        n, k = spec.matrix_shape(role)
        weights, row_scales, values = [], [], []
        for e in range(num_experts):
            block = scales(role, e, (-(-n // BLOCK), -(-k // BLOCK)))
            bits = codes(role, e, (n, k))
            stored = block if scale_part == "weight_scale_inv" else block.view(torch.float8_e8m0fnu)
            matrix = read({"weight": bits.view(torch.float8_e4m3fn), scale_part: stored}, (n, k))
            assert matrix.layout.name == SCALE_PARTS[scale_part] and matrix.layout.group_size == BLOCK
            weights.append(matrix.weight)
            row_scales.append(matrix.scales)
            factor = block.double() if scale_part == "weight_scale_inv" else torch.exp2(block.double() - 127)
            values.append((formats.e4m3_to_float(bits).double() * _expand(factor, n, k)).float())
        tensors[f"{role}.weight"], tensors[f"{role}.scales"] = torch.stack(weights), torch.stack(row_scales)
        reference.append(torch.stack(values))
    return tensors, spec, reference


def random_fp8_codes(gen: torch.Generator):
    """codes() for `block_fp8_layer`: every e4m3 code but NaN (0x7F, 0xFF), at random, each in every projection."""
    every = torch.cat([torch.arange(0x7F), torch.arange(0x80, 0xFF)]).to(torch.uint8)

    def codes(role, e, shape):
        bits = torch.randint(0, 0xFE, shape, generator=gen, dtype=torch.uint8)
        bits += bits >= 0x7F  # 0x7F .. 0xFD -> 0x80 .. 0xFE
        bits.view(-1)[:len(every)] = every[:bits.numel()]
        return bits
    return codes


# ---- extreme E8M0 scales ----------------------------------------------------------------------------------------

def _range(role: str, cls: str) -> tuple[int, int]:
    if cls == "plain":
        return PLAIN
    is_high = (role == "down") == (cls == "small")
    return HIGH if is_high else LOW


def extreme_scales(gen: torch.Generator, role: str, expert: int, shape: tuple[int, int]) -> torch.Tensor:
    """E8M0 bits [rows, groups] for `expert`'s class (module docstring): the extreme (254 or 0) on a checkerboard of
    the groups, the class's other values elsewhere, so every row holds both."""
    lo, hi = _range(role, CLASSES[expert // CLASS_EXPERTS])
    bits = torch.randint(lo, hi + 1, shape, generator=gen)
    if hi == HIGH[1] or lo == LOW[0]:
        extreme = HIGH[1] if hi == HIGH[1] else LOW[0]
        rows, cols = torch.meshgrid(torch.arange(shape[0]), torch.arange(shape[1]), indexing="ij")
        bits = torch.where((rows + cols) % 2 == 0, torch.full_like(bits, extreme), bits)
    return bits.to(torch.uint8)


def extreme_fp8_layer(hidden: int, inter: int, seed: int = 0):
    """FP8 experts with E8M0 `.scale` blocks at the extremes (DeepSeek-V4's layout), 3 classes of CLASS_EXPERTS."""
    gen = torch.Generator().manual_seed(seed)
    every = random_fp8_codes(gen)
    scale_of = {}

    def scales(role, e, shape):
        scale_of[role, e] = extreme_scales(gen, role, e, shape)
        return scale_of[role, e]

    def codes(role, e, shape):
        bits = every(role, e, shape)
        is_high = _expand(scale_of[role, e] >= HIGH[0], *shape)
        return torch.where(is_high, bits & FP8_BELOW_2, bits)

    return block_fp8_layer(len(CLASSES) * CLASS_EXPERTS, hidden, inter, codes, scales, "scale")


def extreme_mxfp4_layer(hidden: int, inter: int, seed: int = 0):
    """MXFP4 experts (DeepSeek-V4's `weight` / `scale` layout, through its reader) with E8M0 scales at the extremes;
    returns `block_fp8_layer`'s three, the reference by `formats.dequantize_mxfp4`."""
    gen = torch.Generator().manual_seed(seed)
    num_experts = len(CLASSES) * CLASS_EXPERTS
    spec = ExpertLayerSpec(num_experts, hidden, inter, "mxfp4", 32, "e8m0")
    tensors, reference = {}, []
    for role in ROLES:
        n, k = spec.matrix_shape(role)
        packed, bits, values = [], [], []
        for e in range(num_experts):
            scale = extreme_scales(gen, role, e, (n, -(-k // 32)))
            codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
            codes[:, :16] = torch.arange(16)
            is_high = scale.long().repeat_interleave(32, 1)[:, :k] >= HIGH[0]
            codes = torch.where(is_high, codes & E2M1_BELOW_2, codes)
            parts = {"weight": formats.pack_fp4(codes).view(torch.int8), "scale": scale.view(torch.float8_e8m0fnu)}
            matrix = read(parts, (n, k))
            assert matrix.layout.name == "e8m0-mxfp4"
            packed.append(matrix.weight)
            bits.append(matrix.scales)
            values.append(formats.dequantize_mxfp4(matrix.weight, matrix.scales, k))
        tensors[f"{role}.weight"], tensors[f"{role}.scales"] = torch.stack(packed), torch.stack(bits)
        reference.append(torch.stack(values))
    assert all(bool(torch.isfinite(w).all()) for w in reference)
    return tensors, spec, reference


def class_tokens(num_tokens: int, hidden: int, top_k: int, seed: int):
    """x [T, H], ids [T, K], weights [T, K]: each token of a random class, routed to distinct experts of that
    class, about a quarter of the slots -1 (the first token's all, when there are several); its activations
    2^X_EXPONENT[class] times +-[1, 2)."""
    gen = torch.Generator().manual_seed(seed)
    cls = torch.randint(0, len(CLASSES), (num_tokens,), generator=gen)
    ids = torch.stack([torch.randperm(CLASS_EXPERTS, generator=gen)[:top_k] for _ in range(num_tokens)])
    ids = ids + cls[:, None] * CLASS_EXPERTS
    ids[torch.rand(ids.shape, generator=gen) < 0.25] = -1
    if num_tokens > 1:
        ids[0] = -1
    exponent = torch.tensor([X_EXPONENT[c] for c in CLASSES], dtype=torch.float64)[cls]
    magnitude = (1 + torch.rand(num_tokens, hidden, generator=gen, dtype=torch.float64)) * torch.exp2(exponent)[:, None]
    signs = torch.randint(0, 2, (num_tokens, hidden), generator=gen) * 2 - 1
    return (magnitude * signs).float(), ids, torch.rand(num_tokens, top_k, generator=gen)


def per_token_scale(want: torch.Tensor) -> torch.Tensor:
    """[T, 1] float64 powers of two that bring each token's largest reference output to [1, 2) (1 for a token
    with none): outputs and bounds times it compare each token on its own scale, exactly."""
    peak = want.double().abs().amax(dim=1, keepdim=True)
    return torch.where(peak > 0, torch.exp2(-torch.floor(torch.log2(peak.clamp(min=1e-300)))), torch.ones_like(peak))
