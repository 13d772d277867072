"""Shared pieces of the `hybrid-convert` tests (a helper module, not a test module): tiny sources, cached
conversions, the references and small file helpers. Test modules import the fixtures they use by name.

Sources are tiny random HuggingFace checkpoints (`checkpoints.make_checkpoint`, stored in bfloat16; the float32 HF
model holding exactly those values is the reference). Conversions go through `convert.cli.main` as a user's command
line would, and the results are loaded with `hybrid.LLM`.

Two references per quantized conversion:
- a *fake-quantized* HF model, whose routed experts are replaced by `dequantize(quantize(w))` with the documented
  formats: our logits must match it to float32 rounding, so any error in the converter's layout, packing, scales or
  expert naming shows at once;
- the unquantized float32 HF model: mean KL and top-1 agreement bound the quantization damage itself (loosely on
  these random models; `test_convert_trained.py` holds trained models to the accuracy targets).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers
from checkpoints import (
    FP8_QUANTIZATION_CONFIG,
    SEEDS,
    VARIANTS,
    build_model,
    fp8_config,
    fp8_dequantize,
    fp8_quantize,
    hf_logits,
    is_fp8_quantized_name,
    make_checkpoint,
    prompt,
    write_config,
)
from safetensors.torch import load_file, save_file

from convert.cli import main
from convert.plan import ROLES, build_plan
from cpu_experts.expert_file import ExpertLayerSpec, dequantize_matrix, quantize_matrix
from hybrid import LLM

transformers.logging.set_verbosity_error()

REPO = Path(__file__).resolve().parents[1]
PARITY_VARIANTS = ("qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe")
PROMPTS = [prompt(64, seed=s) for s in range(4)]  # 4 x 64 = 256 positions per comparison

# name -> (extra command-line arguments, expert dtype, group size written to the files)
CASES = {
    "int8": ([], "int8", 0),  # the default: int8, one scale per output channel
    "int8-g32": (["--expert-dtype", "int8", "--group-size", "32"], "int8", 32),
    "int4": (["--expert-dtype", "int4"], "int4", 128),
    "int4-g32": (["--expert-dtype", "int4", "--group-size", "32"], "int4", 32),
    "bf16": (["--expert-dtype", "bf16"], "bf16", 0),
}

# Converted logits against the fake-quantized reference: only float32 rounding may differ (measured <= 6e-7).
FAKE_QUANT_REL_TOL = 1e-4
# Converted logits against the unquantized reference. These random tiny models (hidden 64, large-spread weights,
# 8 experts) are far more sensitive than trained ones: their next-token distributions are flat and a weight error of
# 0.6% rel-RMS (int8 per channel) flips near-tied router scores. Measured over the 4 variants x 256 positions: int8
# mean KL 1e-4 .. 3.3e-3, top-1 agreement >= 0.97; int4 mean KL 4.7e-3 .. 4.2e-2. The bounds keep a ~3x margin; the
# fake-quantized comparison is the strict one and test_convert_trained.py checks the accuracy targets.
KL_MAX = {"int8": 1e-2, "int4": 1e-1}
TOP1_MIN = {"int8": 0.95}
INT4_OVER_INT8_KL = 4.0  # int4's KL is at least this many times int8's (measured >= 11x)


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """`convert` sets torch's thread count (to --threads) while it runs; check it gives it back."""
    threads = torch.get_num_threads()
    yield
    assert torch.get_num_threads() == threads


# --- sources and conversions ------------------------------------------------------------------------------------------

@dataclass
class Source:
    path: Path
    ref: torch.nn.Module  # float32 HF model holding exactly the stored weights
    ref_logits: list[torch.Tensor]  # over PROMPTS


EXTRA_FILES = {  # small non-weight files a released checkpoint carries; the converter copies them
    "tokenizer_config.json": json.dumps({"model_max_length": 256, "chat_template": "{{ messages }}"}),
    "tokenizer.json": json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {}}}),
    "special_tokens_map.json": json.dumps({"bos_token": "<s>"}),
    "chat_template.jinja": "{% for m in messages %}{{ m.content }}{% endfor %}",
}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """variant -> Source (built once per module)."""
    cache: dict[str, Source] = {}

    def get(variant: str) -> Source:
        if variant not in cache:
            path = tmp_path_factory.mktemp(f"src_{variant}")
            ref = make_checkpoint(VARIANTS[variant](), path, seed=SEEDS[variant], dtype=torch.bfloat16)
            if variant == "qwen3_moe":
                for name, text in EXTRA_FILES.items():
                    (path / name).write_text(text)
            cache[variant] = Source(path, ref, [hf_logits(ref, ids) for ids in PROMPTS])
        return cache[variant]

    return get


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory):
    """(variant, case) -> a finished conversion (shared: tests that damage one work on a copy)."""
    cache: dict[tuple[str, str], Path] = {}

    def get(variant: str, case: str = "int8") -> Path:
        if (variant, case) not in cache:
            dst = tmp_path_factory.mktemp(f"dst_{variant}_{case}") / "out"
            assert main([str(source(variant).path), str(dst), *CASES[case][0]]) == 0
            cache[variant, case] = dst
        return cache[variant, case]

    return get


@pytest.fixture(scope="module")
def metrics(source, converted, tmp_path_factory):
    """(variant, case) -> (mean KL, top-1 agreement) against the unquantized reference, checking on the way that the
    logits match the fake-quantized reference."""
    cache: dict[tuple[str, str], tuple[float, float]] = {}

    def get(variant: str, case: str) -> tuple[float, float]:
        if (variant, case) not in cache:
            src = source(variant)
            _, dtype, group = CASES[case]
            ours = [LLM(converted(variant, case), dtype="float32", expert_activations="float").prefill_logits(ids)
                    for ids in PROMPTS]
            tensors = {n: t.float() for n, t in load_file(str(src.path / "model.safetensors")).items()}
            fake = fake_quant_reference(src.path, tensors, dtype, group, tmp_path_factory.mktemp("fake"))
            for ids, got in zip(PROMPTS, ours, strict=True):
                want = hf_logits(fake, ids)
                err, scale = float((got - want).abs().max()), float(want.abs().max())
                assert err <= FAKE_QUANT_REL_TOL * scale, (
                    f"{variant} {case}: max |ours - fake-quantized HF| = {err:.3e} > {FAKE_QUANT_REL_TOL} * "
                    f"{scale:.3e}")
            cache[variant, case] = kl_and_top1(src.ref_logits, ours)
        return cache[variant, case]

    return get


# --- references -------------------------------------------------------------------------------------------------------

def fake_quant_reference(src: Path, tensors: dict[str, torch.Tensor], dtype: str, group: int, tmp: Path):
    """transformers' model holding `tensors` (float32, checkpoint names) with every routed expert projection replaced
    by its dequantized `dtype` quantization, loaded through transformers' own checkpoint reader."""
    plan = build_plan(src)
    cfg = plan.config
    spec = ExpertLayerSpec(cfg.moe.num_experts, cfg.hidden_size, cfg.moe.intermediate_size, dtype, group)
    tensors = dict(tensors)
    for name, role in expert_names(plan).items():
        parts = quantize_matrix(tensors[name], spec)
        tensors[name] = dequantize_matrix(parts["weight"], parts.get("scales"), role, spec)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def expert_names(plan) -> dict[str, str]:
    """Checkpoint name of every routed expert projection -> its role."""
    cfg = plan.config
    return {plan.expert_name(layer, e, role): role
            for layer in range(cfg.num_layers) if cfg.moe_layers[layer]
            for e in range(cfg.moe.num_experts) for role in ROLES}


def kl_and_top1(refs: list[torch.Tensor], ours: list[torch.Tensor]) -> tuple[float, float]:
    """Mean over positions of KL(p_ref || p_ours) and the fraction of positions with the same argmax."""
    kls, agree = [], []
    for ref, got in zip(refs, ours, strict=True):
        log_p, log_q = ref.log_softmax(-1), got.log_softmax(-1)
        kls.append((log_p.exp() * (log_p - log_q)).sum(-1))
        agree.append((ref.argmax(-1) == got.argmax(-1)).float())
    return float(torch.cat(kls).mean()), float(torch.cat(agree).mean())


# --- FP8-block (DeepSeek-V3) source -----------------------------------------------------------------------------------

def write_fp8_checkpoint(path: Path, stored: dict[str, torch.Tensor], config_dir: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    shutil.copy(config_dir / "config.json", path / "config.json")
    save_file(stored, str(path / "model.safetensors"), metadata={"format": "pt"})
    write_config(path, {"quantization_config": dict(FP8_QUANTIZATION_CONFIG)})


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """A DeepSeek-V3 FP8-block checkpoint: 'path', 'plain' (the unquantized save), 'stored' (tensors as written),
    'dequantized' (float32 values the FP8 tensors stand for)."""
    model = build_model(fp8_config(), seed=17)
    plain = tmp_path_factory.mktemp("fp8_plain")
    model.save_pretrained(plain)
    stored, dequantized = {}, {}
    for name, tensor in sorted(load_file(str(plain / "model.safetensors")).items()):
        if is_fp8_quantized_name(name, tensor):
            q, scale_inv = fp8_quantize(tensor)
            stored[name], stored[name + "_scale_inv"] = q, scale_inv
            dequantized[name] = fp8_dequantize(q, scale_inv)
        else:
            stored[name] = dequantized[name] = tensor
    path = tmp_path_factory.mktemp("fp8_src")
    write_fp8_checkpoint(path, stored, plain)
    return {"path": path, "plain": plain, "stored": stored, "dequantized": dequantized}


@pytest.fixture(scope="module")
def fp8_float_ref(fp8, tmp_path_factory):
    """Logits over PROMPTS of the dequantized float32 model (no expert rounding at all)."""
    tmp = tmp_path_factory.mktemp("fp8_ref")
    save_file({n: t.contiguous() for n, t in fp8["dequantized"].items()}, str(tmp / "model.safetensors"))
    shutil.copy(fp8["plain"] / "config.json", tmp / "config.json")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager")
    return [hf_logits(ref.eval(), ids) for ids in PROMPTS]


# --- files ------------------------------------------------------------------------------------------------------------

def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def all_files(directory: Path) -> dict[str, Path]:
    return {p.relative_to(directory).as_posix(): p for p in sorted(directory.rglob("*")) if p.is_file()}


def digests(directory: Path) -> dict[str, str]:
    """sha256 of every file except the manifest (whose `created` time differs between runs)."""
    return {rel: sha256(p) for rel, p in all_files(directory).items() if rel != "hybrid.json"}


def manifest(directory: Path) -> dict:
    return json.loads((directory / "hybrid.json").read_text())


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def one_line_error(capsys) -> str:
    """The single stderr line of a failed command (no traceback, nothing else)."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("hybrid-convert: error:"), err
    return lines[0]


def fails(capsys, src: Path, dst: Path, *args: str) -> str:
    """Runs a conversion that must fail: exit code 1, one stderr line, no manifest in DST; returns the line."""
    capsys.readouterr()
    assert main([str(src), str(dst), *args]) == 1
    line = one_line_error(capsys)
    assert not (dst / "hybrid.json").exists()
    return line
