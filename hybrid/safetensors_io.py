"""safetensors read and write with bounded memory and exact error messages.

The format: an 8-byte little-endian header length, a JSON header mapping each tensor name to its dtype, shape
and `[begin, end)` byte range in the data section that follows, and the data. The reader parses the header once
and reads a tensor (or one row of a stacked tensor) with `preadv` straight into a fresh tensor, so nothing else
of the file is held in memory or mapped. The writer lays out the header from the tensor specs first, then takes
tensors, or rows of stacked tensors, in any order, and refuses to close a file with bytes never written.
Files are written under a temporary name and renamed only when complete (`commit`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from hybrid.errors import CheckpointError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit the reference implementation enforces
CHUNK_BYTES = 64 * 1024 * 1024
TMP_SUFFIX = ".tmp"


@dataclass(frozen=True)
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """(tensor name -> TensorInfo, `__metadata__`), checking that every range lies inside the file."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (only {size} bytes)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(f"{path}: corrupt safetensors header (declares {header_len} header bytes in a "
                                      f"{size}-byte file)")
            raw = f.read(header_len)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{path}: corrupt safetensors header ({exc})") from None
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + header_len
    tensors = {name: _tensor_info(path, name, entry, data_start) for name, entry in header.items()}
    end = max((t.end for t in tensors.values()), default=data_start)
    if end > size:
        raise CheckpointError(f"{path}: truncated: tensor data ends at byte {end} but the file has {size} bytes")
    _check_disjoint(path, tensors, data_start)
    return tensors, metadata


def _check_disjoint(path: Path, tensors: dict[str, TensorInfo], data_start: int) -> None:
    """Two tensors sharing bytes would read as each other's data; empty tensors own no bytes and may sit anywhere."""
    ranges = sorted((t.begin, t.end, name) for name, t in tensors.items() if t.end > t.begin)
    for prev, (begin, end, name) in zip(ranges, ranges[1:], strict=False):
        if begin < prev[1]:  # sorted and disjoint so far: `prev` is the range that ends last
            raise CheckpointError(
                f"{path}: corrupt safetensors header: tensors '{prev[2]}' (bytes [{prev[0] - data_start}, "
                f"{prev[1] - data_start})) and '{name}' (bytes [{begin - data_start}, {end - data_start})) overlap")


def _tensor_info(path: Path, name: str, entry, data_start: int) -> TensorInfo:
    try:
        dtype = DTYPES[entry["dtype"]]
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = (int(x) for x in entry["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path}: corrupt safetensors header entry for tensor '{name}': {entry!r}") from None
    if begin < 0 or min(shape, default=0) < 0 or end - begin != math.prod(shape) * element_size(dtype):
        raise CheckpointError(f"{path}: corrupt safetensors header: tensor '{name}' has byte range [{begin}, {end}) "
                              f"for shape {shape} of {entry['dtype']}")
    return TensorInfo(dtype, shape, data_start + begin, data_start + end)


class SafetensorsFile:
    """One safetensors file, read by tensor or by row of its first dimension, without mapping it."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.tensors, self.metadata = read_header(self.path)

    def read(self, name: str, row: int | None = None) -> torch.Tensor:
        info = self.tensors[name]
        if row is None:
            return _pread(self.path, info.begin, info.nbytes, info.dtype, info.shape)
        row_bytes = info.nbytes // info.shape[0]
        return _pread(self.path, info.begin + row * row_bytes, row_bytes, info.dtype, info.shape[1:])

    def read_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """Reads tensor `name` into `out` (any contiguous CPU tensor of its size in bytes), e.g. memory the caller
        placed or advised; returns `out` viewed with the tensor's dtype and shape."""
        info = self.tensors[name]
        if not out.is_contiguous() or out.numel() * out.element_size() != info.nbytes:
            raise ValueError(f"{self.path}: buffer for '{name}' must be contiguous with {info.nbytes} bytes")
        raw = out.view(torch.uint8).reshape(-1)
        _pread_into(self.path, info.begin, raw)
        return raw.view(info.dtype).reshape(info.shape)


def _pread(path: Path, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    out = torch.empty(nbytes, dtype=torch.uint8)
    _pread_into(path, offset, out)
    return out.view(dtype).reshape(shape)


def _pread_into(path: Path, offset: int, out: torch.Tensor) -> None:
    """Fills the uint8 tensor `out` from `path` at `offset`."""
    nbytes = out.numel()
    view = memoryview(out.numpy())
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot open ({exc.strerror or exc})") from None
    try:
        done = 0
        while done < nbytes:
            n = os.preadv(fd, [view[done:done + CHUNK_BYTES]], offset + done)
            if n == 0:
                raise CheckpointError(f"{path}: truncated while reading (file shrank during the read)")
            done += n
    except OSError as exc:
        raise CheckpointError(f"{path}: read error ({exc.strerror or exc})") from None
    finally:
        os.close(fd)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class SafetensorsWriter:
    """Writes a safetensors file whose header is fixed up front; tensors or rows may arrive in any order.

    Space is reserved at open (so a full disk fails fast), `close` checks that every byte was written and fsyncs.
    """

    def __init__(self, path: str | Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        self.layout: dict[str, tuple[TensorSpec, int]] = {}
        for spec in specs:
            nbytes = math.prod(spec.shape) * element_size(spec.dtype)
            header[spec.name] = {"dtype": DTYPE_NAMES[spec.dtype], "shape": list(spec.shape),
                                 "data_offsets": [offset, offset + nbytes]}
            self.layout[spec.name] = (spec, offset)
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(len(raw) + 8) % 8)  # data section 8-byte aligned, as the reference writer does
        self.data_start = 8 + len(raw)
        self.size = self.data_start + offset
        self._pending = {name: math.prod(spec.shape) * element_size(spec.dtype) for name, (spec, _) in
                         self.layout.items()}
        self._lock = threading.Lock()  # rows of one file may be written from several threads
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _reserve(self.fd, self.size)
            self._pwrite(struct.pack("<Q", len(raw)) + raw, 0)
        except BaseException:
            self.abort()
            raise

    def write(self, name: str, tensor: torch.Tensor, row: int | None = None, first: int = 0) -> None:
        """Writes all of tensor `name`; or, with `row`, rows `first..first+len(tensor)` of `name[row]` (a stacked
        tensor's entry written whole, or in chunks of its own rows)."""
        spec, offset = self.layout[name]
        entry = spec.shape[1:]
        if row is None:
            expected = spec.shape
        elif not entry:
            expected = ()
        else:
            expected = (tensor.shape[0] if tensor.dim() else 0, *entry[1:])
            if first + expected[0] > entry[0]:
                raise ValueError(f"{self.path}: rows {first}..{first + expected[0]} of '{name}[{row}]' exceed "
                                 f"{entry[0]}")
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != tuple(expected):
            raise ValueError(f"{self.path}: '{name}' expects {spec.dtype} {tuple(expected)}, got {tensor.dtype} "
                             f"{tuple(tensor.shape)}")
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        if row is not None:
            offset += (row * math.prod(entry) + first * math.prod(entry[1:])) * element_size(spec.dtype)
        self._pwrite(memoryview(data), self.data_start + offset)
        with self._lock:
            self._pending[name] -= data.nbytes

    def _pwrite(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:done + CHUNK_BYTES], offset + done)

    def close(self) -> None:
        unwritten = [name for name, left in self._pending.items() if left != 0]
        if unwritten:
            self.abort()
            raise RuntimeError(f"{self.path}: tensor '{unwritten[0]}' was not completely written")
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.path.unlink(missing_ok=True)


def _reserve(fd: int, size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (95, 22):  # EOPNOTSUPP / EINVAL: the file system cannot preallocate; extend instead
            os.ftruncate(fd, size)
        else:
            raise


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def commit(tmp: Path, final: Path) -> None:
    """Atomically renames a finished, fsynced temporary file to its final name and makes the rename durable."""
    os.replace(tmp, final)
    dir_fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + TMP_SUFFIX)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OSError(exc.errno, exc.strerror, str(path)) from None  # name the file (a failed write does not)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    commit(tmp, path)
