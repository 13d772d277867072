"""The converter's options: one frozen dataclass, validated once; the CLI is generated from it."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cpu_experts.expert_file import EXPERT_DTYPES, FIXED_GROUP
from hybrid.errors import ConfigError

GPU_QUANT = ("none", "fp8", "w4a16")
GROUP_MULTIPLE = 32  # scale groups cover whole SIMD vectors in the CPU kernels


@dataclass(frozen=True)
class ConvertOptions:
    expert_dtype: str = field(default="auto", metadata={
        "choices": ("auto", *EXPERT_DTYPES),
        "help": "routed experts' storage: int8, int4 (group-wise), fp8 (e4m3, group-wise), mxfp4, nvfp4 or bf16 "
                "(exact); auto: the source's own quantized experts copied as stored where the CPU experts hold them "
                "(FP8 block/channel, MXFP4, NVFP4, compressed-tensors INT4, e.g. Kimi-K2), int8 for any other "
                "source"})
    group_size: int | None = field(default=None, metadata={
        "help": "expert scale group along the input dimension, a multiple of 32 (default: a quantized source's "
                "own, else 128 for int4 and fp8 and one scale per output channel for int8; mxfp4 and nvfp4 have "
                "fixed groups of 32 and 16)"})
    gpu_quant: str = field(default="none", metadata={
        "choices": GPU_QUANT, "help": "GPU weights: keep as in the source, FP8 (dynamic, per channel) or W4A16 "
                                      "(int4 groups) through llm-compressor, in the compressed-tensors format"})
    gpu_group_size: int = field(default=128, metadata={"help": "W4A16 group size"})
    calib_file: Path | None = field(default=None, metadata={
        "help": "local text file of calibration text: W4A16 uses GPTQ with it instead of round-to-nearest"})
    calib_tokens: int = field(default=2048, metadata={"help": "calibration tokens taken from --calib-file"})
    threads: int = field(default_factory=lambda: os.cpu_count() or 1, metadata={
        "help": "CPU threads for reading and quantizing"})
    overwrite: bool = field(default=False, metadata={
        "help": "replace a finished or differently-configured conversion in DST"})
    allow_nonfinite: bool = field(default=False, metadata={
        "help": "convert source tensors that hold NaN or inf instead of refusing them: they are copied as they are; "
                "a quantization group or channel holding one gets a NaN or inf scale (it dequantizes to NaN)"})

    def __post_init__(self):
        if self.group_size is not None and (self.group_size < 1 or self.group_size % GROUP_MULTIPLE):
            raise ConfigError(f"--group-size must be a positive multiple of {GROUP_MULTIPLE}, got {self.group_size}")
        if self.group_size is not None and self.expert_dtype in ("bf16", *FIXED_GROUP):
            raise ConfigError(f"--group-size applies to int8/int4/fp8 experts; drop it for --expert-dtype "
                              f"{self.expert_dtype}")
        if self.gpu_group_size < 1 or self.gpu_group_size % GROUP_MULTIPLE:
            raise ConfigError(f"--gpu-group-size must be a positive multiple of {GROUP_MULTIPLE}, "
                              f"got {self.gpu_group_size}")
        if self.calib_file is not None and self.gpu_quant != "w4a16":
            raise ConfigError("--calib-file is only used by --gpu-quant w4a16 (FP8 needs no calibration)")
        if self.calib_file is not None and not Path(self.calib_file).is_file():
            raise ConfigError(f"--calib-file {self.calib_file}: no such file")
        if self.calib_tokens < 16:
            raise ConfigError(f"--calib-tokens must be >= 16, got {self.calib_tokens}")
        if self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")

    def check_model(self, hidden_size: int, intermediate_size: int) -> None:
        """Checks --group-size against the routed experts' input sizes: hidden_size (gate/up), intermediate_size
        (down). The int4 default is left alone: it meets only the tiny test models, as one padded group per row."""
        if self.group_size is None:
            return
        for size, what in ((intermediate_size, "the down projection's K, the experts' intermediate size"),
                           (hidden_size, "the gate/up projections' K, the hidden size")):
            if self.group_size > size:
                largest = size // GROUP_MULTIPLE * GROUP_MULTIPLE
                fix = f"use at most {largest}" if largest else "drop --group-size"
                raise ConfigError(f"--group-size {self.group_size} is larger than the routed experts' input dimension "
                                  f"{size} ({what}); {fix}")

    def fingerprint(self, expert_dtype: str, expert_group_size: int) -> dict:
        """The options that decide the output's bytes (a resumed conversion must use the same ones), with the
        experts' dtype and group size as resolved for the source (`convert.experts`): `auto` and the dtype it
        resolves to write the same files."""
        out = asdict(self)
        for transient in ("threads", "overwrite", "allow_nonfinite"):  # a finite source converts the same
            out.pop(transient)
        out["calib_file"] = str(self.calib_file) if self.calib_file else None
        out["expert_dtype"], out["group_size"] = expert_dtype, expert_group_size
        return out
