"""`hybrid-convert` on bad input, bad output locations and bad options: exit code 1 and one stderr line that names
the culprit (no traceback, no manifest); argparse's own errors exit 2. Input it can convert but that is incomplete
(no tokenizer) is a one-line warning."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from checkpoints import SEEDS, VARIANTS, make_checkpoint
from convert_support import (  # noqa: F401 (pytest fixtures: converted, keep_torch_threads, source)
    all_files,
    converted,
    copy_dir,
    fails,
    keep_torch_threads,
    source,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import convert.pipeline
import hybrid.safetensors_io
from convert.cli import main

SHARD = "model-00002-of-00004.safetensors"


def disk_full() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # a fresh one each time: the converter annotates it


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A Qwen3-MoE checkpoint in 4 shards with an index."""
    path = tmp_path_factory.mktemp("sharded")
    make_checkpoint(VARIANTS["qwen3_moe"](), path, seed=SEEDS["qwen3_moe"], dtype=torch.bfloat16,
                    max_shard_size="200KB")
    assert (path / SHARD).is_file() and (path / "model.safetensors.index.json").is_file()
    return path


@pytest.fixture
def src(source, tmp_path):  # noqa: F811
    """A private copy of the single-file Qwen3-MoE source, free to break."""
    return copy_dir(source("qwen3_moe").path, tmp_path / "src")


def edit_tensors(path: Path, edit) -> None:
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


# --- bad sources ------------------------------------------------------------------------------------------------------

def test_missing_shard(sharded, capsys, tmp_path):
    src = copy_dir(sharded, tmp_path / "src")
    (src / SHARD).unlink()
    line = fails(capsys, src, tmp_path / "out")
    assert SHARD in line and "missing" in line, line


def test_truncated_shard(sharded, capsys, tmp_path):
    src = copy_dir(sharded, tmp_path / "src")
    with open(src / SHARD, "r+b") as f:
        f.truncate(os.path.getsize(src / SHARD) - 1000)
    line = fails(capsys, src, tmp_path / "out")
    assert SHARD in line and "truncated" in line, line


@pytest.mark.parametrize("corruption", ["garbage", "header length beyond the file"])
def test_corrupt_header(src, capsys, tmp_path, corruption):
    file = src / "model.safetensors"
    data = bytearray(file.read_bytes())
    if corruption == "garbage":
        data[8:40] = b"\xff\x00garbage!" * 3 + b"\x80" * 5
    else:
        data[:8] = struct.pack("<Q", len(data) + 16)
    file.write_bytes(bytes(data))
    line = fails(capsys, src, tmp_path / "out")
    assert "model.safetensors" in line and "corrupt" in line, line


def test_unknown_architecture(src, capsys, tmp_path):
    config = (src / "config.json").read_text()
    (src / "config.json").write_text(config.replace('"Qwen3MoeForCausalLM"', '"NotAMoeForCausalLM"'))
    line = fails(capsys, src, tmp_path / "out")
    assert "NotAMoeForCausalLM" in line, line


@pytest.mark.parametrize("breakage", ["missing", "leftover"])
def test_fused_experts_missing_or_extra_are_one_line(capsys, tmp_path, breakage):
    """gpt-oss keeps each layer's experts as fused tensors: one missing, or one more beside them, is one line naming
    it, before anything is written."""
    from safetensors.torch import load_file, save_file
    from test_gpt_oss import make_gpt_oss

    make_gpt_oss(tmp_path / "src")
    file = tmp_path / "src" / "model.safetensors"
    tensors = load_file(str(file))
    name = "model.layers.3.mlp.experts.down_proj_bias"
    if breakage == "missing":
        del tensors[name]
    else:
        name = "model.layers.3.mlp.experts.down_proj_scales"
        tensors[name] = torch.zeros(3, dtype=torch.uint8)
    save_file(tensors, str(file))
    line = fails(capsys, tmp_path / "src", tmp_path / "out")
    assert f"'{name}'" in line and ("is missing" if breakage == "missing" else "unexpected tensor") in line, line
    assert not list((tmp_path / "out").glob("experts/*.safetensors"))


@pytest.mark.parametrize("breakage, name", [
    ("missing", "model.layers.2.self_attn.k_proj.weight"),
    ("missing", "model.layers.3.mlp.experts.5.down_proj.weight"),
    ("leftover", "model.layers.1.mlp.extra_proj.weight"),
    ("wrong shape", "model.layers.2.self_attn.q_proj.weight"),
    ("wrong shape", "model.layers.1.mlp.experts.0.up_proj.weight"),
])
def test_bad_tensor(src, capsys, tmp_path, breakage, name):
    def edit(tensors):
        if breakage == "missing":
            del tensors[name]
        elif breakage == "leftover":
            tensors[name] = torch.zeros(8, 64, dtype=torch.bfloat16)
        else:
            tensors[name] = tensors[name][:-1].contiguous()

    edit_tensors(src, edit)
    line = fails(capsys, src, tmp_path / "out")
    assert name in line, line


@pytest.mark.parametrize("name, value, args", [
    ("model.layers.2.self_attn.q_proj.weight", math.nan, []),
    ("model.embed_tokens.weight", -math.inf, []),
    ("model.norm.weight", math.nan, ["--expert-dtype", "int4"]),
    ("model.layers.3.mlp.experts.5.down_proj.weight", math.inf, []),  # int8 per channel
    ("model.layers.1.mlp.experts.0.gate_proj.weight", math.nan, ["--expert-dtype", "int4"]),
    ("model.layers.1.mlp.experts.7.up_proj.weight", -math.inf, ["--expert-dtype", "int8", "--group-size", "32"]),
    ("model.layers.2.mlp.experts.3.up_proj.weight", math.nan, ["--expert-dtype", "bf16"]),
])
def test_nonfinite_source_tensor(src, capsys, tmp_path, name, value, args):
    def edit(tensors):
        tensors[name].view(-1)[tensors[name].numel() // 2 + 1] = value

    edit_tensors(src, edit)
    line = fails(capsys, src, tmp_path / "out", *args)
    assert f"{src / 'model.safetensors'}: tensor '{name}' holds NaN or inf" in line, line
    assert "--allow-nonfinite" in line, line


def test_allow_nonfinite_converts_as_documented(src, capsys, tmp_path):
    """NaN and inf pass through the GPU weights as they are; an expert channel (int8) or group (int4) holding one
    gets that scale, so it dequantizes to NaN; the other channels are untouched; verify then names the layer."""
    dense, expert = "model.layers.2.self_attn.q_proj.weight", "model.layers.3.mlp.experts.5.up_proj.weight"

    def edit(tensors):
        tensors[dense][4, 9] = math.inf
        tensors[expert][6, 40] = math.nan

    edit_tensors(src, edit)
    for args, group in (([], 64), (["--expert-dtype", "int4", "--group-size", "32"], 32)):
        dst = tmp_path / f"out{group}"
        assert main([str(src), str(dst), "--allow-nonfinite", *args]) == 0
        assert load_file(str(dst / "gpu-layer-002.safetensors"))[dense][4, 9] == math.inf
        with safe_open(str(dst / "experts" / "layer-003.safetensors"), framework="pt") as f:
            scales = f.get_tensor("up.scales")[5]
        assert scales[6, 40 // group].isnan() and scales.isfinite().sum() == scales.numel() - 1
        capsys.readouterr()
        assert main(["verify", str(dst), "--source", str(src)]) == 1
        assert "FAILED layer 3 up:" in capsys.readouterr().out


def test_overlapping_tensors_in_a_shard(src, capsys, tmp_path):
    file = src / "model.safetensors"
    data = file.read_bytes()
    header_len = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + header_len])
    first, second = "model.layers.1.self_attn.q_proj.weight", "model.layers.2.self_attn.q_proj.weight"
    header[second]["data_offsets"] = header[first]["data_offsets"]  # same shape: only the overlap is wrong
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + header_len:])
    line = fails(capsys, src, tmp_path / "out")
    assert str(file) in line and first in line and second in line and "overlap" in line, line


def test_source_is_a_converted_output(converted, capsys, tmp_path):  # noqa: F811
    line = fails(capsys, converted("qwen3_moe", "int8"), tmp_path / "out")
    assert "hybrid.json" in line, line
    assert not (tmp_path / "out").exists()


def test_missing_source(capsys, tmp_path):
    line = fails(capsys, tmp_path / "no-such-model", tmp_path / "out")
    assert "no-such-model" in line, line
    assert not (tmp_path / "out").exists()


# --- bad output locations ---------------------------------------------------------------------------------------------

@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_unwritable_dst(src, capsys, tmp_path):
    parent = tmp_path / "readonly"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        line = fails(capsys, src, parent / "out")
    finally:
        parent.chmod(0o755)
    assert str(parent / "out") in line and "not writable" in line, line


def test_dst_below_a_regular_file(src, capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    line = fails(capsys, src, tmp_path / "file" / "out")
    assert str(tmp_path / "file" / "out") in line and "not writable" in line, line


def test_dst_is_a_regular_file(src, capsys, tmp_path):
    dst = tmp_path / "out"
    dst.write_text("precious")
    line = fails(capsys, src, dst)
    assert str(dst) in line and "not a directory" in line, line
    assert dst.read_text() == "precious"


def test_disk_full_during_preallocation(src, capsys, monkeypatch, tmp_path):
    def fallocate(fd, offset, length):
        raise disk_full()

    dst = tmp_path / "out"
    with monkeypatch.context() as patch:
        patch.setattr(hybrid.safetensors_io.os, "posix_fallocate", fallocate)
        line = fails(capsys, src, dst)
    assert "disk full" in line and "gpu-embed.safetensors" in line, line
    assert not list(dst.rglob("*.tmp"))
    assert main([str(src), str(dst)]) == 0  # once there is space, the same command finishes
    assert main(["verify", str(dst)]) == 0


def test_not_enough_disk_space(src, capsys, monkeypatch, tmp_path):
    dst = tmp_path / "out"
    monkeypatch.setattr(convert.pipeline.shutil, "disk_usage",
                        lambda path: SimpleNamespace(total=2**40, used=2**40 - 4096, free=4096))
    line = fails(capsys, src, dst)
    assert "disk space" in line and str(dst) in line, line
    assert not list(dst.glob("*.safetensors")) and not list(dst.glob("experts/*"))


def test_disk_full_while_writing_the_small_files(src, capsys, monkeypatch, tmp_path):
    real = convert.pipeline.write_bytes_atomic

    def write_bytes_atomic(path, data):
        if path.name == "config.json":  # the disk fills up while config.json's temporary file is written
            def fsync(fd):
                raise disk_full()

            with monkeypatch.context() as patch:
                patch.setattr(hybrid.safetensors_io.os, "fsync", fsync)
                return real(path, data)
        return real(path, data)

    dst = tmp_path / "out"
    with monkeypatch.context() as patch:
        patch.setattr(convert.pipeline, "write_bytes_atomic", write_bytes_atomic)
        line = fails(capsys, src, dst)
    assert "disk full" in line and str(dst) in line, line
    assert not (dst / "config.json.tmp").exists() and not (dst / "config.json").exists()
    assert not list(dst.rglob("*.tmp"))
    assert main([str(src), str(dst)]) == 0  # every unit was done: the rerun writes the small files and the manifest
    assert main(["verify", str(dst)]) == 0


@pytest.mark.parametrize("where", ["SRC itself", "inside SRC"])
def test_dst_must_not_be_the_source(src, capsys, where):
    before = all_files(src)
    dst = src if where == "SRC itself" else src / "out"
    line = fails(capsys, src, dst)
    assert "source" in line and str(dst) in line, line
    assert all_files(src) == before and not (src / "experts").exists() and not (src / "out").exists()


# --- options ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, option", [
    (["--group-size", "48"], "--group-size"),
    (["--group-size", "0"], "--group-size"),
    (["--threads", "0"], "--threads"),
    (["--gpu-group-size", "40"], "--gpu-group-size"),
    (["--calib-file", "{calib}", "--gpu-quant", "none"], "--calib-file"),
])
def test_invalid_options(source, capsys, tmp_path, args, option):  # noqa: F811
    calib = tmp_path / "calib.txt"
    calib.write_text("some calibration text " * 100)
    dst = tmp_path / "out"
    line = fails(capsys, source("qwen3_moe").path, dst, *(a.format(calib=calib) for a in args))
    assert option in line, line
    assert not dst.exists()  # options are checked before anything is written


@pytest.mark.parametrize("args, numbers", [
    (["--expert-dtype", "int4", "--group-size", "64"], ("64", "32")),  # above the down projection's K (32)
    (["--expert-dtype", "int8", "--group-size", "96"], ("96", "32")),
])
def test_group_size_above_the_experts_input(source, capsys, tmp_path, args, numbers):  # noqa: F811
    dst = tmp_path / "out"
    line = fails(capsys, source("qwen3_moe").path, dst, *args)
    assert "--group-size" in line and all(n in line for n in numbers), line
    assert not dst.exists()  # checked before anything is written


def test_missing_tokenizer_is_a_warning(src, capsys, tmp_path):
    capsys.readouterr()
    assert main([str(src), str(tmp_path / "with")]) == 0
    assert capsys.readouterr().err == ""
    (src / "tokenizer.json").unlink()  # tokenizer_config.json alone is no tokenizer
    assert main([str(src), str(tmp_path / "without")]) == 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hybrid-convert: warning:") and "tokenizer" in lines[0], lines
    assert str(src) in lines[0]
    assert (tmp_path / "without" / "hybrid.json").is_file()


@pytest.mark.parametrize("args, option", [
    (["--expert-dtype", "int3"], "--expert-dtype"),
    (["--bogus"], "--bogus"),
])
def test_unparseable_options(source, capsys, tmp_path, args, option):  # noqa: F811
    dst = tmp_path / "out"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main([str(source("qwen3_moe").path), str(dst), *args])
    assert exc.value.code == 2
    assert option in capsys.readouterr().err
    assert not dst.exists()


def test_unbroken_copies_convert(src, sharded, tmp_path):
    """The sources the tests above break convert when left whole."""
    for source_dir in (src, copy_dir(sharded, tmp_path / "sharded")):
        assert main([str(source_dir), str(tmp_path / "out")]) == 0
        shutil.rmtree(tmp_path / "out")
