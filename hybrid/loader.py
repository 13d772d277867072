"""Weight loading straight from a HuggingFace checkpoint directory.

Reads sharded safetensors (with `model.safetensors.index.json`) or single files, one tensor at a time, so the
peak extra memory is one tensor. DeepSeek-style FP8 weights (`X.weight` in float8_e4m3fn with a float32
`X.weight_scale_inv` per 128x128 block) are dequantized on the CPU. Before anything is copied, the set of
checkpoint tensors is compared with what the model expects: a missing, unexpected or mis-shaped tensor is a
`CheckpointError` naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from hybrid.errors import CheckpointError

SCALE_SUFFIX = "_scale_inv"
INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(checkpoint_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it, from the index or from the files' headers."""
    index = checkpoint_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: unreadable safetensors index ({exc})") from None
        names = {name: checkpoint_dir / file for name, file in weight_map.items()}
        for file in sorted(set(names.values())):
            if not file.is_file():
                raise CheckpointError(f"{file}: shard listed in {INDEX_FILE} is missing")
        return names
    files = sorted(checkpoint_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{checkpoint_dir}: no *.safetensors files found")
    names: dict[str, Path] = {}
    for file in files:
        for name in _open(file).keys():  # noqa: SIM118 (a safe_open handle, not a dict)
            names[name] = file
    return names


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises several types for corrupt headers
        raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from None


class TensorReader:
    """Reads named tensors, keeping one open handle per shard."""

    def __init__(self, files: dict[str, Path]):
        self.files = files
        self._handles: dict[Path, object] = {}

    def read(self, name: str) -> torch.Tensor:
        file = self.files[name]
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = _open(file)
        try:
            return handle.get_tensor(name)
        except Exception as exc:
            raise CheckpointError(f"{file}: cannot read tensor '{name}' ({exc})") from None


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight [out, in] (float8) * scale_inv [ceil(out / bo), ceil(in / bi)] broadcast over blocks -> float32."""
    rows, cols = weight.shape
    block_rows, block_cols = block
    expected = (-(-rows // block_rows), -(-cols // block_cols))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale shape {tuple(scale_inv.shape)} does not match {expected} for weight {rows}x{cols}")
    scale = scale_inv.float().repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]
    return weight.float() * scale


def load_weights(model, checkpoint_dir: str | Path) -> None:
    """Copies every checkpoint tensor into `model` (a `MoECausalLM`), checking names and shapes first."""
    checkpoint_dir = Path(checkpoint_dir)
    files = checkpoint_files(checkpoint_dir)
    targets = model.checkpoint_targets()
    scales = {name for name in files if name.endswith(SCALE_SUFFIX)}
    present = {name for name in files if name not in scales and not model.is_ignored_tensor(name)}
    _check_names(checkpoint_dir, targets, present, scales, model)
    reader = TensorReader(files)
    block = model.config.fp8_block_size
    for name in sorted(present):
        tensor = reader.read(name)
        target = targets[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise CheckpointError(
                f"{files[name]}: tensor '{name}' has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
            )
        scale_name = name + SCALE_SUFFIX
        if scale_name in scales:
            tensor = _dequantize(reader, files, name, tensor, scale_name, block)
        elif tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise CheckpointError(f"{files[name]}: FP8 tensor '{name}' has no '{scale_name}'")
        with torch.no_grad():
            target.copy_(tensor)


def _dequantize(reader, files, name, tensor, scale_name, block) -> torch.Tensor:
    if block is None:
        raise CheckpointError(
            f"{files[scale_name]}: '{scale_name}' found but config.json has no fp8 quantization_config"
        )
    try:
        return dequantize_fp8_block(tensor, reader.read(scale_name), block)
    except ValueError as exc:
        raise CheckpointError(f"{files[scale_name]}: '{scale_name}': {exc}") from None


def _check_names(checkpoint_dir: Path, targets: dict, present: set[str], scales: set[str], model) -> None:
    missing = sorted(set(targets) - present - model.optional_tensor_names())
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{checkpoint_dir}: missing tensor '{missing[0]}'{more}")
    unexpected = sorted(present - set(targets))
    orphan_scales = sorted(s for s in scales if s[: -len(SCALE_SUFFIX)] not in present)
    unexpected += [s for s in orphan_scales if not model.is_ignored_tensor(s)]
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(f"{checkpoint_dir}: unexpected tensor '{unexpected[0]}'{more} not used by the model")
