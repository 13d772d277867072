"""The SM120 gate (`python -m gpu_layers.gate`): every gpu_layers kernel is covered and fits its targets, and the
gate does fail an oversized kernel and an uncovered one. It runs as a subprocess without TRITON_INTERPRET, since
it compiles real JITFunctions offline (no GPU needed). The first run compiles every case (minutes on two cores);
reruns hit Triton's cache."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "gpu_layers"

OVERSIZED = '''
import triton
import triton.language as tl
from gpu_layers.capability import GateCase


@triton.jit
def big_matmul_kernel(a_ptr, b_ptr, c_ptr, K, BLOCK: tl.constexpr):
    rows = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK, BLOCK], tl.float32)
    for k in range(0, K, BLOCK):
        a = tl.load(a_ptr + rows[:, None] * K + (k + rows)[None, :])
        b = tl.load(b_ptr + (k + rows)[:, None] * BLOCK + rows[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + rows[:, None] * BLOCK + rows[None, :], acc)


def gate_cases():
    # 4 stages of two 128 x 128 bf16 tiles: 128 KiB and more, over SM120's 99 KiB, under Hopper's 227 KiB.
    signature = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*fp32", "K": "i32", "BLOCK": "constexpr"}
    return [GateCase(big_matmul_kernel, signature, {"BLOCK": 128}, cc, f"big_matmul sm{cc}", num_warps=8,
                     num_stages=4) for cc in (89, 90, 120)]
'''

UNCOVERED = '''
import triton
import triton.language as tl
from gpu_layers.capability import GateCase


@triton.jit
def covered_kernel(x_ptr, BLOCK: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, BLOCK), tl.zeros([BLOCK], tl.float32))


@triton.jit
def orphan_kernel(x_ptr):
    tl.store(x_ptr, 1.0)


@triton.jit
def _inlined_helper(x):
    return x


def gate_cases():
    return [GateCase(covered_kernel, {"x_ptr": "*fp32", "BLOCK": "constexpr"}, {"BLOCK": 64}, cc, f"covered sm{cc}")
            for cc in (89, 90, 120)]
'''


def run_gate(*args: str) -> tuple[int, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "gpu_layers.gate", "--json", *args], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=1800)
    assert result.stdout.strip(), result.stderr[-2000:]
    return result.returncode, json.loads(result.stdout)


def jit_kernels_in_source() -> set[str]:
    """Public module-level functions decorated with triton.jit/autotune/heuristics, read from the source."""
    names = set()
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            decorators = [ast.unparse(d) for d in node.decorator_list]
            if any(d.startswith(("triton.jit", "triton.autotune", "triton.heuristics")) for d in decorators):
                names.add(f"gpu_layers.{path.stem}.{node.name}")
    return names


def test_every_kernel_passes_the_gate():
    returncode, report = run_gate()
    assert returncode == 0 and report["ok"], "\n".join(report["failures"])
    expected = jit_kernels_in_source()
    assert {"gpu_layers.norm.rms_norm_kernel", "gpu_layers.rotary.rotary_kernel"} <= expected
    assert set(report["kernels"]) == expected
    checked = {(f"{row['module']}.{row['kernel']}", row["capability"]) for row in report["cases"]}
    for kernel in expected:
        for capability in (89, 90, 120):
            assert (kernel, capability) in checked, f"{kernel} not compiled for sm_{capability}"
    for row in report["cases"]:
        assert row["shared"] <= row["limit"] and row["stack"] == 0 and row["local"] == 0, row


def test_oversized_kernel_fails_on_sm120_but_fits_sm90(tmp_path):
    module = tmp_path / "oversized.py"
    module.write_text(OVERSIZED)
    returncode, report = run_gate("--skip-package", "--extra-module", str(module))
    assert returncode == 1 and not report["ok"]
    rows = {row["capability"]: row for row in report["cases"]}
    assert rows[120]["shared"] > rows[120]["limit"] == 101376
    assert any("shared memory" in reason for reason in rows[120]["reasons"])
    assert rows[90]["reasons"] == [] and rows[90]["shared"] > 101376
    assert any("'big_matmul sm120'" in f and "shared memory" in f for f in report["failures"])

    returncode, report = run_gate("--skip-package", "--extra-module", str(module), "--capability", "90")
    assert returncode == 0 and [row["capability"] for row in report["cases"]] == [90]


def test_kernel_without_gate_case_is_named(tmp_path):
    module = tmp_path / "uncovered.py"
    module.write_text(UNCOVERED)
    returncode, report = run_gate("--skip-package", "--extra-module", str(module))
    assert returncode == 1
    assert report["failures"] == ["gate_extra_uncovered.orphan_kernel: has no gate case"]
    assert set(report["kernels"]) == {"gate_extra_uncovered.covered_kernel", "gate_extra_uncovered.orphan_kernel"}


def test_module_that_does_not_import_fails(tmp_path):
    module = tmp_path / "broken.py"
    module.write_text("import triton\nraise RuntimeError('half-written module')\n")
    returncode, report = run_gate("--skip-package", "--extra-module", str(module))
    assert returncode == 1
    assert len(report["failures"]) == 1 and "does not import" in report["failures"][0]
    assert "half-written module" in report["failures"][0]
