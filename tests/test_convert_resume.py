"""`hybrid-convert verify`, and reruns of `hybrid-convert` into a directory that already holds something: an
interrupted or killed conversion (resumed), a finished one (verified, or replaced with --overwrite), a damaged one
(repaired file by file)."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from convert_support import (  # noqa: F401 (pytest fixtures: converted, keep_torch_threads, source)
    REPO,
    all_files,
    converted,
    copy_dir,
    digests,
    fails,
    keep_torch_threads,
    manifest,
    one_line_error,
    source,
)
from safetensors.torch import load_file, save_file

import convert.pipeline
import hybrid.native_experts
from convert.cli import main

ROW = re.compile(r"^\s*(\d+)\s+(\S+)\s+(\S+)\s+(\S+)\s*$", re.M)  # "layer  gate  up  down" of verify --source
UNIT_FILES = ["gpu-embed.safetensors", "gpu-layer-000.safetensors", "gpu-layer-001.safetensors",
              "experts/layer-001.safetensors", "gpu-layer-002.safetensors", "experts/layer-002.safetensors",
              "gpu-layer-003.safetensors", "experts/layer-003.safetensors"]  # qwen3_moe, in the order written


def stats(directory: Path, only=None) -> dict[str, tuple[int, int]]:
    """rel -> (inode, mtime_ns): a file rewritten (even atomically, with the same bytes) changes both."""
    return {rel: (p.stat().st_ino, p.stat().st_mtime_ns) for rel, p in all_files(directory).items()
            if only is None or rel in only}


def flip_byte(path: Path, offset: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def expert_errors(capsys, dst: Path, src: Path) -> dict[int, tuple[float, float, float]]:
    """verify --source: layer -> relative RMS error of (gate, up, down), parsed from its output."""
    capsys.readouterr()
    assert main(["verify", str(dst), "--source", str(src)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^layer\s+rel-RMS gate\s+up\s+down$", out, re.M), out
    assert "files OK" in out
    return {int(m[1]): (float(m[2]), float(m[3]), float(m[4])) for m in ROW.finditer(out)}


def resumed_count(out: str) -> tuple[int, int]:
    match = re.search(r"wrote (\d+) weight files, (\d+) already done", out)
    assert match, out
    return int(match[1]), int(match[2])


# --- verify ----------------------------------------------------------------------------------------------------------

def test_verify_a_finished_conversion(converted, capsys):  # noqa: F811
    dst = converted("qwen3_moe", "int8")
    capsys.readouterr()
    assert main(["verify", str(dst)]) == 0
    out = capsys.readouterr().out
    assert f"{len(manifest(dst)['files'])} files OK" in out
    assert "FAILED" not in out


def test_verify_reports_the_expert_error(source, converted, capsys):  # noqa: F811
    src = source("qwen3_moe").path
    errors = {case: expert_errors(capsys, converted("qwen3_moe", case), src) for case in ("bf16", "int8", "int4")}
    for case, rows in errors.items():
        assert sorted(rows) == [1, 2, 3], (case, rows)  # the MoE layers (layer 0 is dense)
    for layer in (1, 2, 3):
        assert errors["bf16"][layer] == (0.0, 0.0, 0.0)
        for int8, int4 in zip(errors["int8"][layer], errors["int4"][layer], strict=True):
            assert 0 < int8 < 0.02
            assert int4 > int8


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_verify_fails_on_a_nonfinite_expert_error(source, converted, capsys, tmp_path, value):  # noqa: F811
    """A NaN error compares false against any bound: verify must fail on it, naming the layer and role."""
    dst = converted("qwen3_moe", "int8")
    src = copy_dir(source("qwen3_moe").path, tmp_path / "src")
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.2.mlp.experts.4.down_proj.weight"][1, 2] = value
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    capsys.readouterr()
    assert main(["verify", str(dst), "--source", str(src)]) == 1
    captured = capsys.readouterr()
    failed = [line for line in captured.out.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and failed[0].startswith("FAILED layer 2 down:") and "nan" in failed[0], captured.out
    assert "NaN or inf" in captured.err and "Traceback" not in captured.err


def test_verify_detects_a_flipped_byte(converted, capsys, tmp_path):  # noqa: F811
    dst = copy_dir(converted("qwen3_moe", "int8"), tmp_path / "out")
    flip_byte(dst / "experts" / "layer-002.safetensors")
    capsys.readouterr()
    assert main(["verify", str(dst)]) == 1
    captured = capsys.readouterr()
    assert "experts/layer-002.safetensors" in captured.out + captured.err
    assert "layer-001" not in captured.out + captured.err


def test_verify_detects_a_deleted_file(converted, capsys, tmp_path):  # noqa: F811
    dst = copy_dir(converted("qwen3_moe", "int8"), tmp_path / "out")
    (dst / "gpu-layer-001.safetensors").unlink()
    capsys.readouterr()
    assert main(["verify", str(dst)]) == 1
    captured = capsys.readouterr()
    assert "gpu-layer-001.safetensors" in captured.out + captured.err


def test_verify_refuses_an_unfinished_directory(converted, capsys, tmp_path):  # noqa: F811
    dst = copy_dir(converted("qwen3_moe", "int8"), tmp_path / "out")
    (dst / "hybrid.json").unlink()
    capsys.readouterr()
    assert main(["verify", str(dst)]) == 1
    assert "hybrid.json" in one_line_error(capsys)


# --- interrupted and killed conversions ------------------------------------------------------------------------------

@pytest.mark.parametrize("threads", ["1", "2"])
def test_interrupted_conversion_resumes(source, converted, capsys, monkeypatch, tmp_path, threads):  # noqa: F811
    src = source("qwen3_moe").path
    dst = tmp_path / "out"
    args = [str(src), str(dst), "--threads", threads]
    real_write, real_quantize = convert.pipeline.write_expert_unit, hybrid.native_experts.quantize_matrix
    units = []

    def write_expert_unit(plan, unit, path, spec, num_threads, is_passthrough):
        units.append(unit.path)
        if len(units) < 2:
            return real_write(plan, unit, path, spec, num_threads, is_passthrough)
        count = itertools.count()

        def quantize(w, spec):  # Ctrl-C halfway through the second expert file, its temporary file half written
            if next(count) == 10:
                raise KeyboardInterrupt
            return real_quantize(w, spec)

        with monkeypatch.context() as patch:
            patch.setattr(hybrid.native_experts, "quantize_matrix", quantize)
            real_write(plan, unit, path, spec, num_threads, is_passthrough)
        raise AssertionError("not interrupted")

    capsys.readouterr()
    with monkeypatch.context() as patch:
        patch.setattr(convert.pipeline, "write_expert_unit", write_expert_unit)
        assert main(args) == 130
    assert units == ["experts/layer-001.safetensors", "experts/layer-002.safetensors"]
    assert "run the same command again to resume" in capsys.readouterr().err
    assert not (dst / "hybrid.json").exists()
    assert not list(dst.rglob("*.tmp"))
    finished = UNIT_FILES[:5]  # everything before experts/layer-002
    before = stats(dst, finished)
    assert sorted(before) == sorted(finished)

    line = fails(capsys, src, dst, "--expert-dtype", "int4")  # other options: refused, progress kept
    assert "--overwrite" in line
    assert stats(dst, finished) == before

    assert main(args) == 0
    assert resumed_count(capsys.readouterr().out) == (len(UNIT_FILES) - len(finished), len(finished))
    assert stats(dst, finished) == before
    assert not (dst / ".hybrid-convert").exists()
    assert digests(dst) == digests(converted("qwen3_moe", "int8"))


# Run in a child process (killed with SIGKILL: no cleanup of any kind runs); every quantized projection is slowed
# down so that the kill lands in the middle of the conversion.
LAUNCHER = """
import sys, time
import hybrid.native_experts
from convert.cli import main
delay, real = float(sys.argv[1]), hybrid.native_experts.quantize_matrix

def slow(w, spec):
    time.sleep(delay)
    return real(w, spec)

hybrid.native_experts.quantize_matrix = slow
sys.exit(main(sys.argv[2:]))
"""


def kill_midway(src: Path, dst: Path, delay: float) -> list[str] | None:
    """Starts the conversion, SIGKILLs it once the journal lists a finished file; returns the files the journal
    lists then, or None when the child finished first."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests"),
                                                       os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(delay), str(src), str(dst), "--threads", "1"],
                             cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    progress = dst / ".hybrid-convert" / "progress.json"
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            if child.poll() is not None:
                assert child.returncode == 0, child.stderr.read().decode()
                return None
            try:
                listed = list(json.loads(progress.read_text())["files"])
            except (OSError, ValueError, KeyError):
                listed = []
            if listed:
                child.send_signal(signal.SIGKILL)
                child.wait()
                return None if child.returncode == 0 else listed
            time.sleep(0.005)
        raise AssertionError("the conversion did not start within 120 s")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stderr.close()


def test_killed_conversion_resumes(source, converted, capsys, tmp_path):  # noqa: F811
    src = source("qwen3_moe").path
    for attempt, delay in enumerate((0.02, 0.1, 0.5)):  # a longer delay whenever the child finished first
        dst = tmp_path / f"out{attempt}"
        listed = kill_midway(src, dst, delay)
        if listed is not None:
            break
    else:
        pytest.fail("the conversion always finished before it could be killed")
    assert not (dst / "hybrid.json").exists()
    assert listed and set(listed) <= set(UNIT_FILES)
    before = stats(dst, listed)

    capsys.readouterr()
    assert main([str(src), str(dst), "--threads", "1"]) == 0
    written, done = resumed_count(capsys.readouterr().out)
    assert done >= len(listed) and written + done == len(UNIT_FILES)
    assert stats(dst, listed) == before
    assert not list(dst.rglob("*.tmp"))
    assert main(["verify", str(dst)]) == 0
    assert digests(dst) == digests(converted("qwen3_moe", "int8"))


# --- reruns into a finished directory --------------------------------------------------------------------------------

def test_rerun_on_a_finished_conversion(source, converted, capsys, tmp_path):  # noqa: F811
    src = source("qwen3_moe").path
    dst = copy_dir(converted("qwen3_moe", "int8"), tmp_path / "out")
    before = stats(dst)

    capsys.readouterr()
    assert main([str(src), str(dst)]) == 0
    assert "already holds this conversion" in capsys.readouterr().out
    assert stats(dst) == before
    assert not (dst / ".hybrid-convert").exists()

    assert main([str(src), str(dst), "--expert-dtype", "int4"]) == 1
    assert "--overwrite" in one_line_error(capsys)
    assert stats(dst) == before

    assert main([str(src), str(dst), "--expert-dtype", "int4", "--overwrite"]) == 0
    assert manifest(dst)["experts"]["dtype"] == "int4"
    assert digests(dst) == digests(converted("qwen3_moe", "int4"))
    assert main(["verify", str(dst)]) == 0


def test_rerun_repairs_a_damaged_conversion(source, converted, capsys, tmp_path):  # noqa: F811
    src = source("qwen3_moe").path
    dst = copy_dir(converted("qwen3_moe", "int8"), tmp_path / "out")
    damaged = "experts/layer-002.safetensors"
    flip_byte(dst / damaged)
    others = [rel for rel in UNIT_FILES if rel != damaged]
    before = stats(dst, others)

    capsys.readouterr()
    assert main([str(src), str(dst)]) == 0
    assert resumed_count(capsys.readouterr().out) == (1, len(others))
    assert stats(dst, others) == before
    assert digests(dst) == digests(converted("qwen3_moe", "int8"))
    assert main(["verify", str(dst)]) == 0


def test_overwrite_replaces_an_unreadable_manifest(source, converted, capsys, tmp_path):  # noqa: F811
    src = source("qwen3_moe").path
    dst = copy_dir(converted("qwen3_moe", "int8"), tmp_path / "out")
    (dst / "hybrid.json").write_text("{garbage")

    capsys.readouterr()
    assert main([str(src), str(dst)]) == 1  # without --overwrite: refused, naming the manifest
    assert "hybrid.json" in one_line_error(capsys)

    assert main([str(src), str(dst), "--overwrite"]) == 0
    assert main(["verify", str(dst)]) == 0
    assert digests(dst) == digests(converted("qwen3_moe", "int8"))


def test_overwrite_leaves_only_the_new_conversion(source, converted, capsys, tmp_path):  # noqa: F811
    dst = copy_dir(converted("qwen3_moe", "int8"), tmp_path / "out")  # 4 layers, tokenizer files
    (dst / "my-notes.txt").write_text("not the converter's")
    assert main([str(source("mixtral").path), str(dst), "--overwrite"]) == 0  # 3 layers, no tokenizer files
    listed = {entry["path"] for entry in manifest(dst)["files"]}
    assert set(all_files(dst)) == listed | {"hybrid.json", "my-notes.txt"}
    assert (dst / "my-notes.txt").read_text() == "not the converter's"
    assert "gpu-layer-003.safetensors" not in listed and "tokenizer.json" not in listed
    assert manifest(dst)["source"]["architecture"] == "MixtralForCausalLM"
    assert main(["verify", str(dst)]) == 0


def test_a_changed_source_is_not_taken_for_the_converted_one(source, converted, capsys, tmp_path):  # noqa: F811
    """A shard rewritten in place with the same size (new values, new mtime) or a changed tokenizer file makes a
    different source: the rerun refuses to treat DST as this conversion instead of reporting it finished."""
    src = copy_dir(source("qwen3_moe").path, tmp_path / "src")
    dst = copy_dir(converted("qwen3_moe", "int8"), tmp_path / "out")
    shard = src / "model.safetensors"
    shard.write_bytes(shard.read_bytes())  # rewritten in place: same size, new modification time
    os.utime(shard, ns=(time.time_ns(), time.time_ns() + 10**9))
    capsys.readouterr()
    assert main([str(src), str(dst)]) == 1
    assert "--overwrite" in one_line_error(capsys)
    dst2 = copy_dir(converted("qwen3_moe", "int8"), tmp_path / "out2")
    src2 = copy_dir(source("qwen3_moe").path, tmp_path / "src2")  # copytree keeps the modification times
    assert main([str(src2), str(dst2)]) == 0 and "already holds" in capsys.readouterr().out
    (src2 / "chat_template.jinja").write_text("{{ changed }}")
    assert main([str(src2), str(dst2)]) == 1
    assert "--overwrite" in one_line_error(capsys)


def test_a_repaired_small_file_is_reported_as_written(source, converted, capsys, tmp_path):  # noqa: F811
    src = source("qwen3_moe").path
    dst = copy_dir(converted("qwen3_moe", "int8"), tmp_path / "out")
    (dst / "generation_config.json").write_text((dst / "generation_config.json").read_text() + " ")
    capsys.readouterr()
    assert main([str(src), str(dst)]) == 0
    out = capsys.readouterr().out
    assert "already holds" not in out and "wrote 0 weight files" in out
    assert main(["verify", str(dst)]) == 0
