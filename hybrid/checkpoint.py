"""The tensors of one checkpoint directory, by the names the model expects, with the source's quantization undone.

A checkpoint stores some weights as several tensors: DeepSeek FP8 `X.weight` + `X.weight_scale_inv`, or the
compressed-tensors forms (`X.weight` + `X.weight_scale` for FP8, `X.weight_packed` + `X.weight_scale` +
`X.weight_shape` for packed INT4, NVFP4 and the other layouts of `hybrid.stored_matrix`). `Checkpoint` groups
them under the logical name `X.weight`, so the loader and
the converter see one tensor per parameter; `read` returns it dequantized (float32), `read_raw` one stored tensor
and `read_parts` / `part_infos` all of a logical tensor's stored parts (or their headers) by their suffix after the
module's name (`weight`, `weight_scale_inv`, `weight_packed`, ...), for modules that keep them quantized. Files
are read with `hybrid.safetensors_io` (one tensor at a time, nothing mapped).

Names are the model's: a family whose published checkpoint nests the text model under other prefixes (Kimi-K2.5:
`language_model.model.*`, `language_model.lm_head.*`) gives `prefixes`, (published, model) pairs, and every stored
name that starts with a published prefix is known by the model's spelling (`model.*`, `lm_head.*`); the stored
spelling is kept for reading. Names without such a prefix stay as they are (a `hybrid-convert` output stores the
model's names).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybrid import compressed_tensors, stored_matrix
from hybrid.errors import CheckpointError
from hybrid.safetensors_io import SafetensorsFile, TensorInfo
from hybrid.stored_matrix import FP8_DTYPES, Layout

INDEX_FILE = "model.safetensors.index.json"
FP8_SCALE_SUFFIX = "_scale_inv"
E8M0_SCALE_SUFFIX = ".scale"  # DeepSeek-V4: `X.scale` beside `X.weight`
MODELOPT_SUFFIXES = (".weight_scale_2", ".weight_scale", ".input_scale")  # NVIDIA ModelOpt NVFP4, beside `X.weight`
# layouts whose dequantization is `hybrid.stored_matrix`'s (the others predate it: `read` keeps their own code)
DECODED_LAYOUTS = ("e8m0-fp8", "e8m0-mxfp4", "ct-nvfp4", "modelopt-nvfp4")


@dataclass
class Checkpoint:
    directory: Path
    files: dict[str, SafetensorsFile]  # stored tensor name -> the file that holds it
    fp8_block: tuple[int, int] | None = None
    compressed: compressed_tensors.Scheme | None = None
    parts: dict[str, list[str]] = field(default_factory=dict)  # logical name -> stored names, logical first
    stored_names: dict[str, str] = field(default_factory=dict)  # model's name -> stored name, where they differ
    is_modelopt: bool = False  # NVIDIA ModelOpt NVFP4 (`hybrid.config.parse_modelopt`)

    @classmethod
    def open(cls, directory: str | Path, fp8_block: tuple[int, int] | None = None,
             compressed: compressed_tensors.Scheme | None = None,
             exclude: Iterable[str] = (), prefixes: tuple[tuple[str, str], ...] = (),
             is_modelopt: bool = False) -> Checkpoint:
        """Reads the index (or every shard's header) and groups the stored tensors; `exclude`d files (e.g. the
        converted experts, which have a reader of their own) are skipped when scanning headers; `prefixes`:
        (published, model) name prefixes (module docstring)."""
        directory = Path(directory)
        files, stored_names = _rename(_files(directory, set(exclude)), prefixes)
        ckpt = cls(directory, files, fp8_block, compressed, stored_names=stored_names, is_modelopt=is_modelopt)
        ckpt.parts = ckpt._group()
        return ckpt

    def _group(self) -> dict[str, list[str]]:
        parts: dict[str, list[str]] = {}
        for name in sorted(self.files):
            parts.setdefault(self.logical_name(name), []).append(name)
        for logical, stored in parts.items():
            stored.sort(key=lambda n: n != logical)
        return parts

    def logical_name(self, stored: str) -> str:
        if self.fp8_block is not None and stored.endswith(FP8_SCALE_SUFFIX):
            return stored[: -len(FP8_SCALE_SUFFIX)]
        if self.fp8_block is not None and stored.endswith(E8M0_SCALE_SUFFIX):
            return stored[: -len(E8M0_SCALE_SUFFIX)] + ".weight"
        if self.compressed is not None:
            return compressed_tensors.logical_name(stored)
        if self.is_modelopt:
            for suffix in MODELOPT_SUFFIXES:
                if stored.endswith(suffix):
                    return stored[: -len(suffix)] + ".weight"
        return stored

    def layout(self, name: str) -> Layout | None:
        """The quantized layout logical tensor `name` is stored in (`hybrid.stored_matrix`), from its headers; None
        for a tensor stored as it is."""
        if len(self.parts.get(name, ())) < 2:
            return None
        return stored_matrix.identify(self.part_infos(name), self.fp8_block, self.compressed, self.is_modelopt)

    def read_matrix(self, name: str, layout: Layout, shape: tuple[int, int] | None = None,
                    check: stored_matrix.Check | None = None) -> stored_matrix.StoredMatrix:
        """Logical tensor `name`'s stored parts in `layout`, decoded (bits kept); every failure one line naming the
        stored tensor and its file. `check(stored name, tensor)`: see `stored_matrix.decode`."""
        prefix = name.rpartition(".")[0] + "."
        parts = self.read_parts(name)
        try:
            return stored_matrix.decode(parts, layout, shape, check and (lambda part, t: check(prefix + part, t)))
        except stored_matrix.PartError as exc:
            raise CheckpointError(f"{self.file_of(prefix + exc.part)}: '{prefix}{exc.part}' {exc.detail}") from None

    def info(self, stored: str) -> TensorInfo:
        return self.files[stored].tensors[self.stored_names.get(stored, stored)]

    def file_of(self, name: str) -> Path:
        if name in self.files:
            return self.files[name].path
        return self.files[self.parts[name][0]].path

    def read_raw(self, stored: str) -> torch.Tensor:
        return self.files[stored].read(self.stored_names.get(stored, stored))

    def read_row(self, stored: str, row: int) -> torch.Tensor:
        """Row `row` of stored tensor `stored`'s first dimension, read alone (one expert of a fused 3-D tensor)."""
        return self.files[stored].read(self.stored_names.get(stored, stored), row)

    def part_infos(self, name: str) -> dict[str, TensorInfo]:
        """The headers of logical tensor `name`'s stored parts, by suffix (`X.weight_scale` -> `weight_scale`)."""
        prefix = name.rpartition(".")[0] + "."
        return {stored[len(prefix):]: self.info(stored) for stored in self.parts[name]}

    def read_parts(self, name: str) -> dict[str, torch.Tensor]:
        """The stored parts of logical tensor `name` as stored (nothing dequantized), by suffix."""
        prefix = name.rpartition(".")[0] + "."
        return {stored[len(prefix):]: self.read_raw(stored) for stored in self.parts[name]}

    def read(self, name: str) -> torch.Tensor:
        """The logical tensor `name`: as stored, or dequantized to float32 when stored quantized."""
        stored = self.parts[name]
        layout = self.layout(name)
        if layout is not None and (layout.name in DECODED_LAYOUTS or layout.name == "ct-fp8" and self.compressed
                                   and self.compressed.strategy in ("group", "block")):
            return self.read_matrix(name, layout, check=self.refuse_nonfinite).dequantize()
        if self.compressed is not None and stored != [name]:
            try:
                return compressed_tensors.dequantize({s: self.read_raw(s) for s in stored}, name,
                                                self.compressed.group_size)
            except ValueError as exc:
                raise CheckpointError(f"{self.file_of(name)}: '{name}': {exc}") from None
        self.check_parts(name)
        tensor = self.read_raw(name)
        scale_name = name + FP8_SCALE_SUFFIX
        if scale_name in stored:
            return dequantize_fp8_block(tensor, self.read_raw(scale_name), self.fp8_block)  # shapes checked above
        if tensor.dtype in FP8_DTYPES:
            raise CheckpointError(f"{self.file_of(name)}: FP8 tensor '{name}' has no '{scale_name}'")
        return tensor

    def refuse_nonfinite(self, stored: str, tensor: torch.Tensor) -> None:
        """The runtime's `stored_matrix.Check`: a stored tensor holding NaN or inf is a CheckpointError."""
        if not stored_matrix.is_finite(tensor):
            raise CheckpointError(f"{self.file_of(stored)}: tensor '{stored}' holds NaN or inf values (NaN codes or "
                                  "scales); repair the checkpoint")

    def check_parts(self, name: str) -> None:
        """Checks from the headers alone that `name`'s stored parts fit together (FP8 weight and block scale)."""
        if self.fp8_block is None:
            return
        scale_name = name + FP8_SCALE_SUFFIX
        if name not in self.files:
            raise CheckpointError(f"{self.file_of(name)}: '{scale_name}' has no weight '{name}'")
        info = self.info(name)
        if info.dtype not in FP8_DTYPES:
            return
        e8m0_name = name.removesuffix(".weight") + E8M0_SCALE_SUFFIX
        if scale_name not in self.files and e8m0_name in self.files:
            scale_name = e8m0_name
        if scale_name not in self.files:
            raise CheckpointError(f"{self.file_of(name)}: FP8 tensor '{name}' has no '{scale_name}'")
        *experts, rows, cols = info.shape  # a fused 3-D experts tensor [E, N, K] has blocks per expert
        expected = (*experts, -(-rows // self.fp8_block[0]), -(-cols // self.fp8_block[1]))
        if tuple(self.info(scale_name).shape) != expected:
            raise CheckpointError(f"{self.files[scale_name].path}: '{scale_name}' has shape "
                                  f"{tuple(self.info(scale_name).shape)}, expected {expected} for weight "
                                  f"{'x'.join(map(str, info.shape))}")

    def logical_shape(self, name: str) -> tuple[int, ...] | None:
        """The shape `read(name)` returns, from the headers; None when only reading tells (packed weights)."""
        if name not in self.files:
            return None
        if len(self.parts[name]) > 1 and not self.info(name).dtype.is_floating_point:
            return None  # packed (two FP4 codes a byte): the shape is the model's to say
        return tuple(self.info(name).shape)


def _files(directory: Path, exclude: set[str]) -> dict[str, SafetensorsFile]:
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: unreadable safetensors index ({exc})") from None
        opened: dict[str, SafetensorsFile] = {}
        files = {}
        for name, file in sorted(weight_map.items()):
            path = directory / file
            if file not in opened:
                if not path.is_file():
                    raise CheckpointError(f"{path}: shard listed in {INDEX_FILE} is missing")
                opened[file] = SafetensorsFile(path)
            if name not in opened[file].tensors:
                raise CheckpointError(f"{path}: tensor '{name}' listed in {INDEX_FILE} is not in this shard")
            files[name] = opened[file]
        return files
    paths = [p for p in sorted(directory.glob("*.safetensors")) if p.name not in exclude]
    if not paths:
        raise CheckpointError(f"{directory}: no *.safetensors files found")
    files = {}
    for path in paths:
        shard = SafetensorsFile(path)
        files.update({name: shard for name in shard.tensors})
    return files


def model_name(stored: str, prefixes: tuple[tuple[str, str], ...]) -> str:
    """The model's name of a stored tensor: its published prefix replaced by the model's (first match)."""
    for published, model in prefixes:
        if stored.startswith(published):
            return model + stored[len(published):]
    return stored


def published_name(name: str, prefixes: tuple[tuple[str, str], ...]) -> str:
    """The published name of the model's tensor `name` (the inverse of `model_name`)."""
    for published, model in prefixes:
        if name.startswith(model):
            return published + name[len(model):]
    return name


def _rename(files: dict[str, SafetensorsFile], prefixes: tuple[tuple[str, str], ...]
            ) -> tuple[dict[str, SafetensorsFile], dict[str, str]]:
    """(model's name -> file, model's name -> stored name where they differ); two stored tensors with one model's
    name (the published and the model's spelling both present) are an error."""
    renamed: dict[str, SafetensorsFile] = {}
    stored_names: dict[str, str] = {}
    for stored, file in files.items():
        name = model_name(stored, prefixes)
        if name in renamed:
            other = stored_names.get(name, name)
            raise CheckpointError(f"{file.path}: tensors '{other}' and '{stored}' are both '{name}'; keep one")
        renamed[name] = file
        if name != stored:
            stored_names[name] = stored
    return renamed, stored_names


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight [..., out, in] (float8) * scale_inv [..., ceil(out / bo), ceil(in / bi)] broadcast over blocks ->
    float32 (leading dims: fused 3-D experts [E, out, in], blocks per expert)."""
    *lead, rows, cols = weight.shape
    block_rows, block_cols = block
    expected = (*lead, -(-rows // block_rows), -(-cols // block_cols))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale shape {tuple(scale_inv.shape)} does not match {expected} for weight "
                         f"{'x'.join(map(str, weight.shape))}")
    scale = scale_inv.float().repeat_interleave(block_rows, -2)[..., :rows, :]
    return weight.float() * scale.repeat_interleave(block_cols, -1)[..., :cols]
