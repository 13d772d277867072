"""`hybrid-convert` streams: its peak memory is a few layers' worth, not the model's.

A synthetic Qwen3-MoE checkpoint of many identical layers (hidden 1024, 16 experts of intermediate 512: ~54 MiB of
bf16 per layer) is written shard by shard (one per layer, plus an index) without ever holding the whole model. Each
conversion runs in a child process that reports its own peak RSS (VmHWM); a baseline child imports the same
modules and builds the same plan but converts nothing. The difference must stay under 3 layers + 64 MiB, while the
model is several times that, so a converter that held the model (or even a few layers too many) fails.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
MiB = 2**20
NUM_LAYERS = 12
ALLOWANCE = 64 * MiB
LAYERS_BOUND = 3
DISK_NEEDED = 1300 * MiB  # the ~0.65 GiB source, one ~0.37 GiB output at a time (each removed when measured), slack

# The child's peak RSS is VmHWM, the high-water mark of its own address space. Not `ru_maxrss`: Linux carries the
# larger of it over exec, and subprocess starts children with vfork, so a child's ru_maxrss starts at the parent's
# (this pytest process's) peak, which here is well above what the converter needs. Both are printed.
CHILD = """
import resource, sys

def vm_hwm():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

mode, args = sys.argv[1], sys.argv[2:]
rc = 0
if mode == "baseline":  # the same modules and the same plan, nothing converted
    import convert.cli, convert.options, convert.pipeline, convert.units
    from convert.plan import build_plan
    assert build_plan(args[0]).units
else:
    if mode == "leak":  # a converter that keeps every tensor it reads: the measurement must see it
        import hybrid.checkpoint
        held, real = [], hybrid.checkpoint.Checkpoint.read_raw
        def read_raw(self, stored):
            held.append(real(self, stored))
            return held[-1]
        hybrid.checkpoint.Checkpoint.read_raw = read_raw
    from convert.cli import main
    rc = main(args)
print("PEAK", vm_hwm(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
sys.exit(rc)
"""


def synthetic_config() -> transformers.Qwen3MoeConfig:
    return transformers.Qwen3MoeConfig(
        vocab_size=1024, hidden_size=1024, num_hidden_layers=NUM_LAYERS, num_attention_heads=8, num_key_value_heads=4,
        head_dim=128, intermediate_size=1024, moe_intermediate_size=512, num_experts=16, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=1, max_position_embeddings=256,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        bos_token_id=1, eos_token_id=2, pad_token_id=0, architectures=["Qwen3MoeForCausalLM"])


@pytest.fixture(scope="session")
def big_checkpoint(tmp_path_factory):
    """(path, bytes of the largest layer, bytes of the whole model)."""
    from hybrid.models import load_model_config

    path = tmp_path_factory.mktemp("big_src")
    free = shutil.disk_usage(path).free
    if free < DISK_NEEDED:  # a machine's disk is not the converter's memory: say so rather than fail on it
        pytest.skip(f"needs {DISK_NEEDED / MiB:.0f} MiB free under {path} for the source and one output, "
                    f"has {free / MiB:.0f}")
    synthetic_config().save_pretrained(path)
    cls, config = load_model_config(path)
    with torch.device("meta"):
        targets = cls(config).checkpoint_targets()  # checkpoint name -> meta tensor of the expected shape
    groups: dict[str, list[str]] = {}
    for name in sorted(targets):
        match = re.match(r"model\.layers\.(\d+)\.", name)
        groups.setdefault(f"layer-{int(match[1]):03d}" if match else "other", []).append(name)
    assert len(groups) == NUM_LAYERS + 1
    gen = torch.Generator().manual_seed(0)
    weight_map, layer_bytes, total = {}, [], 0
    for group, names in sorted(groups.items()):
        file = f"model-{group}.safetensors"
        tensors = {}
        for name in names:  # one shard in memory at a time
            shape = tuple(targets[name].shape)
            tensors[name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
            weight_map[name] = file
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        total += nbytes
        if group != "other":
            layer_bytes.append(nbytes)
        del tensors
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    assert len(set(layer_bytes)) == 1  # identical layers
    yield path, max(layer_bytes), total
    shutil.rmtree(path)  # ~0.7 GB: CI's /tmp is small and pytest keeps every test's directory until the run ends


def peak_rss(mode: str, *args: str) -> tuple[int, int]:
    """(VmHWM, ru_maxrss) in bytes of a child running in `mode` with `args`."""
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    match = re.search(r"^PEAK (\d+) (\d+)$", proc.stdout, re.MULTILINE)
    assert match, proc.stdout
    return int(match[1]), int(match[2])


@pytest.fixture(scope="session")
def baseline(big_checkpoint):
    return peak_rss("baseline", str(big_checkpoint[0]))


def convert_and_measure(mode, big_checkpoint, baseline, dst, threads) -> tuple[int, int]:
    """(bytes used over the baseline, the bound)."""
    src, layer, total = big_checkpoint
    bound = LAYERS_BOUND * layer + ALLOWANCE
    assert total > 2.5 * bound  # holding the whole model would break the bound several times over
    try:
        peak, maxrss = peak_rss(mode, str(src), str(dst), "--threads", str(threads))
        assert (dst / "hybrid.json").is_file()
        assert len(list((dst / "experts").glob("layer-*.safetensors"))) == NUM_LAYERS
    finally:  # each output is ~0.37 GB; three of them beside the source filled CI's /tmp
        shutil.rmtree(dst, ignore_errors=True)
    used = peak - baseline[0]
    print(f"\n{mode}, threads {threads}: model {total / MiB:.0f} MiB, one layer {layer / MiB:.1f} MiB; peak RSS "
          f"(VmHWM) baseline {baseline[0] / MiB:.0f} MiB, converting {peak / MiB:.0f} MiB: used {used / MiB:.0f} MiB, "
          f"bound {bound / MiB:.0f} MiB (ru_maxrss: baseline {baseline[1] / MiB:.0f}, converting "
          f"{maxrss / MiB:.0f} MiB)")
    return used, bound


@pytest.mark.parametrize("threads", [1, 2])
def test_peak_memory_is_a_few_layers(big_checkpoint, baseline, tmp_path, threads):
    used, bound = convert_and_measure("convert", big_checkpoint, baseline, tmp_path / "out", threads)
    layer = big_checkpoint[1]
    assert used < bound, (f"converting used {used / MiB:.0f} MiB over the baseline, more than {LAYERS_BOUND} layers "
                          f"({layer / MiB:.1f} MiB each) + {ALLOWANCE / MiB:.0f} MiB")


def test_the_measurement_sees_a_converter_that_holds_the_model(big_checkpoint, baseline, tmp_path):
    used, bound = convert_and_measure("leak", big_checkpoint, baseline, tmp_path / "out", 1)
    assert used > max(bound, 0.9 * big_checkpoint[2])
