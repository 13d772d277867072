"""`convert(source, dst, options)`: plan, then write unit after unit, then the small files, then the manifest.

Every file is written under a temporary name and renamed when complete; the journal records each finished unit
so an interrupted run resumes where it stopped; the manifest goes last.
"""

from __future__ import annotations

import errno
import json
import math
import shutil
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import torch
from tqdm import tqdm

from convert import experts, gpu_quant
from convert.manifest import (
    JOURNAL_DIR,
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    Journal,
    file_entry,
    read_manifest,
    source_fingerprint,
    write_manifest,
)
from convert.options import ConvertOptions
from convert.plan import TOKENIZER_FILES, Plan, Unit, build_plan, has_tokenizer
from convert.units import write_expert_unit, write_gpu_unit
from hybrid.checkpoint import INDEX_FILE
from hybrid.errors import HybridError, OutputError
from hybrid.safetensors_io import TMP_SUFFIX, commit, element_size, write_bytes_atomic

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".ckpt")


@dataclass
class Report:
    dst: Path
    written: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # units found complete and verified (resume)
    is_already_done: bool = False  # DST held this exact conversion, checksums intact: nothing was written
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)  # one line each: the conversion is usable but incomplete
    notes: list[str] = field(default_factory=list)  # one line each: what was decided for the user (expert format)


def convert(source: str | Path, dst: str | Path, options: ConvertOptions, progress: bool | None = None) -> Report:
    start = time.perf_counter()
    source, dst = Path(source), Path(dst)
    plan = build_plan(source, options.allow_nonfinite)
    options.check_model(plan.config.hidden_size, plan.config.moe.intermediate_size)
    expert_format = experts.resolve(plan, options)
    quantizer = gpu_quant.make_quantizer(plan, options)
    _prepare(source, dst)
    key = {"format_version": MANIFEST_VERSION,
           "options": options.fingerprint(expert_format.dtype, expert_format.group_size),
           "source": source_fingerprint(source, sorted({f.path for f in plan.ckpt.files.values()}),
                                        _small_files(source), options.calib_file)}
    threads = torch.get_num_threads()
    try:
        if options.overwrite:
            _clear_previous(dst)
        report = _convert(plan, quantizer, dst, key, options, expert_format, progress)
    except OutputError:
        raise
    except OSError as exc:  # the output side: the source reader raises CheckpointError for its own failures
        raise _output_error(dst, exc) from None
    finally:
        torch.set_num_threads(threads)
    report.seconds = time.perf_counter() - start
    if expert_format.note():
        report.notes.append(expert_format.note())
    if not has_tokenizer(source):  # reported once the conversion succeeded, so that an error stays one line
        report.warnings.append(f"{source} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); "
                               f"hybrid-serve needs them: copy them into {dst}")
    return report


def _convert(plan: Plan, quantizer, dst: Path, key: dict, options: ConvertOptions,
             expert_format: experts.ExpertFormat, progress) -> Report:
    report = Report(dst)
    if _finished_already(dst, key):
        report.skipped = [unit.path for unit in plan.units]
        report.is_already_done = True
        return report
    journal = Journal(dst, key)
    previous = journal.load()
    if previous is not None and previous.get("key") != key:
        raise OutputError(f"{dst}: holds an unfinished conversion of another source or other options; rerun with "
                          "the same ones to resume, or pass --overwrite")
    done = journal.resume(dst) if previous is not None else {}
    todo = [unit for unit in plan.units if unit.path not in done]
    spec = expert_format.model_spec(plan.model)  # the model's activation and biases (gpt-oss) recorded in the files
    _check_space(dst, sum(_unit_bytes(plan, unit, quantizer, spec) for unit in todo))
    _remove_stale_temporaries(dst)
    journal.start()
    torch.set_num_threads(options.threads)
    quantizer.prepare(todo)
    bar = tqdm(total=sum(u.source_bytes for u in plan.units), unit="B", unit_scale=True, unit_divisor=1024,
               desc="hybrid-convert", disable=None if progress is None else not progress)
    with bar:
        for unit in plan.units:
            if unit.path in done:
                report.skipped.append(unit.path)
            else:
                _write_unit(plan, unit, dst, quantizer, spec, options.threads, expert_format.is_passthrough)
                journal.record(file_entry(dst, unit.path))
                report.written.append(unit.path)
            bar.update(unit.source_bytes)
    small = _write_small_files(plan, dst, quantizer)
    entries = [journal.done[u.path] for u in plan.units] + [file_entry(dst, rel) for rel in small]
    write_manifest(dst, _manifest(plan, expert_format, quantizer, key, entries))
    journal.remove()
    return report


def _output_error(path: Path, exc: OSError) -> OutputError:
    """A one-line error for a failed write; `path` names the file (or DST) when the OSError does not."""
    where = exc.filename or path
    if exc.errno == errno.ENOSPC:
        return OutputError(f"{where}: disk full while writing; free space and rerun the same command to resume")
    return OutputError(f"{where}: cannot write ({exc.strerror or exc})")


def _prepare(source: Path, dst: Path) -> None:
    if dst.resolve() == source.resolve() or source.resolve() in dst.resolve().parents:
        raise OutputError(f"{dst}: the output must not be the source directory or inside it")
    if dst.exists() and not dst.is_dir():
        raise OutputError(f"{dst}: exists and is not a directory")
    try:
        (dst / "experts").mkdir(parents=True, exist_ok=True)
        probe = dst / f".write-test{TMP_SUFFIX}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise OutputError(f"{dst}: not writable ({exc.strerror or exc})") from None


def _finished_already(dst: Path, key: dict) -> bool:
    """True when DST already holds this exact conversion with every checksum intact. A finished conversion with
    damaged files is turned back into an unfinished one (its intact files are kept); one of another source or
    other options needs --overwrite."""
    manifest = read_manifest(dst)
    if manifest is None:
        return False
    if manifest.get("key") != key:
        raise OutputError(f"{dst}: already holds a finished conversion of another source or other options; "
                          "pass --overwrite to replace it")
    if not Journal(dst, key).resume_from(dst, manifest.get("files") or []):
        return True
    (dst / MANIFEST_FILE).unlink()  # from here on the directory is unfinished again
    return False


def _clear_previous(dst: Path) -> None:
    """--overwrite: removes what an earlier conversion wrote, its manifest first (so DST never looks finished),
    whether or not that manifest is readable. Files the converter did not write are left alone."""
    listed: list[str] = []
    try:
        manifest = read_manifest(dst)
        listed = [entry["path"] for entry in (manifest or {}).get("files", [])]
    except (HybridError, KeyError, TypeError):
        pass  # unreadable: the file patterns below still find the converter's files
    (dst / MANIFEST_FILE).unlink(missing_ok=True)
    shutil.rmtree(dst / JOURNAL_DIR, ignore_errors=True)
    root = dst.resolve()
    owned = [*dst.glob("gpu-*.safetensors"), *(dst / "experts").glob("layer-*.safetensors"), dst / INDEX_FILE]
    for path in owned + [dst / rel for rel in listed]:
        if path.is_file() and root in path.resolve().parents:
            path.unlink()


def _unit_bytes(plan: Plan, unit: Unit, quantizer, spec) -> int:
    if unit.is_experts:
        return sum(math.prod(shape) * element_size(dtype) for shape, dtype in spec.tensor_shapes().values())
    return sum(math.prod(s.shape) * element_size(s.dtype) for n in unit.names for s in quantizer.specs(plan, n))


def _check_space(dst: Path, needed: int) -> None:
    free = shutil.disk_usage(dst).free
    if needed > free:
        raise OutputError(f"{dst}: not enough disk space: the conversion needs {_size(needed)} more, "
                          f"{_size(free)} are free")


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


def _remove_stale_temporaries(dst: Path) -> None:
    for folder in (dst, dst / "experts"):
        for tmp in folder.glob(f"*{TMP_SUFFIX}"):
            tmp.unlink()


def _write_unit(plan: Plan, unit: Unit, dst: Path, quantizer, spec, threads: int, is_passthrough: bool) -> None:
    final = dst / unit.path
    tmp = final.with_name(final.name + TMP_SUFFIX)
    try:
        if unit.is_experts:
            write_expert_unit(plan, unit, tmp, spec, threads, is_passthrough)
        else:
            write_gpu_unit(plan, unit, tmp, quantizer)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OutputError):
            raise
        raise _output_error(final, exc) from None
    commit(tmp, final)


def _write_small_files(plan: Plan, dst: Path, quantizer) -> list[str]:
    """The safetensors index of the GPU weights, config.json (with the GPU quantization recorded) and every
    other small source file (tokenizer, generation config, chat template, remote code), each atomically."""
    weight_map = {}
    for unit in plan.units:
        if not unit.is_experts:
            weight_map.update({spec.name: unit.path for n in unit.names for spec in quantizer.specs(plan, n)})
    written = [INDEX_FILE]
    write_bytes_atomic(dst / INDEX_FILE, json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2).encode())
    config = json.loads((plan.source / "config.json").read_text())
    if (config.get("quantization_config") or {}).get("quant_method") == "mxfp4":
        del config["quantization_config"]  # gpt-oss: its MXFP4 tensors (the experts) are in the expert files now
    quantizer.update_config(config)
    write_bytes_atomic(dst / "config.json", (json.dumps(config, indent=2) + "\n").encode())
    written.append("config.json")
    for path in _small_files(plan.source):
        write_bytes_atomic(dst / path.name, path.read_bytes())
        written.append(path.name)
    return written


def _small_files(source: Path) -> list[Path]:
    """The source's files other than weights, its index and config.json (tokenizer, templates, remote code)."""
    return [path for path in sorted(source.iterdir())
            if path.is_file() and path.name not in ("config.json", INDEX_FILE, MANIFEST_FILE)
            and not path.name.endswith(WEIGHT_SUFFIXES)]


def _manifest(plan: Plan, expert_format: experts.ExpertFormat, quantizer, key: dict, entries: list[dict]) -> dict:
    try:
        version = metadata.version("hybrid")
    except metadata.PackageNotFoundError:
        version = "unknown"
    config = plan.config
    return {
        "format": MANIFEST_FORMAT,
        "format_version": MANIFEST_VERSION,
        "converter": f"hybrid-convert {version}",
        "key": key,
        "source": {"path": str(plan.source.resolve()), "architecture": config.architecture},
        "model": {"num_layers": config.num_layers, "moe_layers": config.moe_layer_indices,
                  "num_experts": config.moe.num_experts, "hidden_size": config.hidden_size,
                  "moe_intermediate_size": config.moe.intermediate_size},
        "experts": {"dtype": expert_format.dtype, "group_size": expert_format.group_size,
                    "scale_dtype": expert_format.scale_dtype, "is_copied_from_source": expert_format.is_passthrough,
                    "layout": "hybrid-experts v1",
                    "files": {str(u.layer): u.path for u in plan.units if u.is_experts}},
        "gpu": {"quantization": quantizer.name, "method": quantizer.method, "index": INDEX_FILE},
        "files": entries,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
