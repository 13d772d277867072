"""The SM120 gate: every kernel config the runtime can select compiles for its target and fits it.

    python -m gpu_layers.gate [--capability 120] [--json] [--extra-module PATH] [--skip-package] [--jobs 2]

Imports every module of the gpu_layers package (and any --extra-module file), collects each module-level
@triton.jit function it defines (names starting with "_" are helpers inlined into kernels and are skipped) and
each module's `gate_cases()`. It fails when a module does not import, when a kernel has no GateCase for a checked
capability (the runtime could select an unchecked config there), or when a case
  - does not compile offline for GPUTarget("cuda", capability, 32),
  - needs more shared memory than SHARED_MEMORY_LIMIT[capability] (compiled.metadata.shared, which Triton checks
    against the device's opt-in maximum at launch),
  - spills: a stack frame or local memory in cuobjdump's resource usage, or spill bytes in `ptxas -v`,
  - needs more registers than a block can have (registers x threads > 65536), or
  - uses wgmma / tcgen05 on a target other than SM90.
One row per case (label, capability, shared bytes, limit, registers, verdict); exit status 1 on any failure, one
line per failure naming the case and the reason.

Kernels must be real JITFunctions, so the gate drops TRITON_INTERPRET before it imports them (the tests run it as a
subprocess for that reason). Pointer arguments are compiled as 16-byte aligned, the specialisation a launch with
torch-allocated tensors gets. Compiles, and their resource reports, use Triton's own cache; two worker processes
share the work.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import multiprocessing
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from gpu_layers.capability import CAPABILITIES, SHARED_MEMORY_LIMIT, GateCase

REGISTERS_PER_BLOCK = 65536
FORBIDDEN_OFF_SM90 = ("wgmma", "tcgen05")  # Hopper / datacenter-Blackwell instructions SM120 and Ada lack
USAGE_FILE = "gate_resource_usage.json"  # per compiled kernel, in Triton's cache directory
_CASES: list[tuple[str, GateCase]] = []  # read by the forked workers


def load_modules(extra_paths: list[str], skip_package: bool) -> tuple[list, list[str]]:
    """The gpu_layers modules (gate itself excluded) and the extra module files; failures as one-line messages."""
    import gpu_layers

    modules, failures = [], []
    names = [] if skip_package else [f"gpu_layers.{m.name}" for m in pkgutil.iter_modules(gpu_layers.__path__)]
    for name in names:
        if name == __name__ or name == "gpu_layers.gate":
            continue
        try:
            modules.append(importlib.import_module(name))
        except Exception as exc:
            failures.append(f"{name}: does not import: {_one_line(exc)}")
    for path in extra_paths:
        name = f"gate_extra_{Path(path).stem}"
        try:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # Triton reads the kernels' source through the module
            spec.loader.exec_module(module)
            modules.append(module)
        except Exception as exc:
            failures.append(f"{path}: does not import: {_one_line(exc)}")
    return modules, failures


def _one_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _jit_function(obj):
    """The JITFunction under obj (through autotune/heuristics wrappers), else None."""
    from triton.runtime.jit import JITFunction, KernelInterface

    while isinstance(obj, KernelInterface) and not isinstance(obj, JITFunction) and hasattr(obj, "fn"):
        obj = obj.fn
    return obj if isinstance(obj, JITFunction) else None


def module_kernels(module) -> tuple[dict[str, object], list[str]]:
    """Public module-level jit functions defined in `module` (not imported into it), by name; failures."""
    from triton.runtime.interpreter import InterpretedFunction

    kernels, failures = {}, []
    for name, obj in vars(module).items():
        if name.startswith("_"):
            continue
        if isinstance(obj, InterpretedFunction) and obj.fn.__module__ == module.__name__:
            failures.append(f"{module.__name__}.{name}: imported under TRITON_INTERPRET, not a compiled kernel")
            continue
        jit = _jit_function(obj)
        if jit is not None and jit.fn.__module__ == module.__name__:
            kernels[name] = jit
    return kernels, failures


def collect(modules, capabilities) -> tuple[list[tuple[str, GateCase]], list[str], list[str]]:
    """(module name, case) for the checked capabilities, the kernels' qualified names, and coverage failures."""
    cases, kernel_names, failures = [], [], []
    for module in modules:
        kernels, kernel_failures = module_kernels(module)
        failures += kernel_failures
        module_cases = []
        if hasattr(module, "gate_cases"):
            try:
                module_cases = list(module.gate_cases())
            except Exception as exc:
                failures.append(f"{module.__name__}.gate_cases(): raised {_one_line(exc)}")
        elif kernels:
            failures.append(f"{module.__name__}: has kernels but no gate_cases()")
        covered = set()
        for case in module_cases:
            jit = _jit_function(case.kernel)
            if jit is None:
                failures.append(f"{module.__name__}: gate case {case.label!r} names no triton.jit kernel")
                continue
            covered.add((id(jit), case.capability))
            if case.capability in capabilities:
                cases.append((module.__name__, case))
        for name, jit in kernels.items():
            kernel_names.append(f"{module.__name__}.{name}")
            missing = [cc for cc in capabilities if (id(jit), cc) not in covered]
            if len(missing) == len(capabilities):
                failures.append(f"{module.__name__}.{name}: has no gate case")
            elif missing:
                failures.append(f"{module.__name__}.{name}: has no gate case for capability {missing}")
    return cases, kernel_names, failures


def _compile(case: GateCase):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    jit = _jit_function(case.kernel)
    aligned = {(jit.arg_names.index(name),): [["tt.divisibility", 16]]
               for name, kind in case.signature.items() if kind.startswith("*")}
    source = ASTSource(fn=jit, signature=case.signature, constexprs=case.constexprs, attrs=aligned)
    options = {"num_warps": case.num_warps, "num_stages": case.num_stages, **case.extra}
    return triton.compile(source, target=GPUTarget("cuda", case.capability, 32), options=options)


def _nvidia_tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG / STACK / SHARED / LOCAL of the cubin's kernel, from cuobjdump --dump-resource-usage."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        text = subprocess.run([_nvidia_tool("cuobjdump"), "--dump-resource-usage", str(path)],
                              capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    if found is None:
        raise RuntimeError(f"no resource usage in cuobjdump output: {text[:200]!r}")
    return dict(zip(("registers", "stack", "static_shared", "local"), map(int, found.groups()), strict=True))


def ptxas_spill_bytes(ptx: str, capability: int) -> int:
    """Spill stores + loads that `ptxas -v` reports for the PTX (Triton's own ptxas, same target)."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        log = subprocess.run([get_ptxas(capability).path, "-v", f"--gpu-name={sm_arch_from_capability(capability)}",
                              str(source), "-o", str(Path(tmp) / "kernel.o")],
                             capture_output=True, text=True, check=True).stderr
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))


def cached_usage(compiled, capability: int) -> dict[str, int]:
    """resource_usage + ptxas_spill_bytes, kept beside the compiled kernel in Triton's cache (keyed by its hash)."""
    from triton.runtime.cache import get_cache_manager

    cache = get_cache_manager(compiled.hash)
    path = cache.get_file(USAGE_FILE)
    if path is not None:
        return json.loads(Path(path).read_text())
    usage = resource_usage(compiled.asm["cubin"])
    usage["spill_bytes"] = ptxas_spill_bytes(compiled.asm["ptx"], capability)
    cache.put(json.dumps(usage), USAGE_FILE, binary=False)
    return usage


def check_case(index: int) -> dict:
    """Compiles _CASES[index] and returns its row; 'reasons' is empty when it passes."""
    module_name, case = _CASES[index]
    limit = SHARED_MEMORY_LIMIT[case.capability]
    row = {"module": module_name, "kernel": getattr(getattr(_jit_function(case.kernel), "fn", None), "__name__", "?"),
           "label": case.label, "capability": case.capability, "limit": limit, "shared": None,
           "registers": None, "stack": None, "local": None, "spill_bytes": None, "reasons": []}
    try:
        compiled = _compile(case)
    except Exception as exc:
        row["reasons"].append(f"does not compile: {_one_line(exc)}")
        return row
    row["shared"] = compiled.metadata.shared
    row.update(cached_usage(compiled, case.capability))
    threads = 32 * case.num_warps
    if row["shared"] > limit:
        row["reasons"].append(f"shared memory {row['shared']} B > {limit} B")
    if row["stack"] or row["local"] or row["spill_bytes"]:
        row["reasons"].append(f"spills: stack {row['stack']} B, local {row['local']} B, "
                              f"ptxas spill {row['spill_bytes']} B")
    if row["registers"] * threads > REGISTERS_PER_BLOCK:
        row["reasons"].append(f"{row['registers']} registers x {threads} threads > {REGISTERS_PER_BLOCK}")
    if case.capability != 90:
        used = [op for op in FORBIDDEN_OFF_SM90 if op in compiled.asm["ptx"]]
        if used:
            row["reasons"].append(f"uses {', '.join(used)}, which sm_{case.capability} lacks")
    return row


def run_gate(capabilities, extra_paths=(), skip_package=False, jobs=2) -> dict:
    """Collects, compiles and checks; returns {ok, kernels, cases (rows), failures (one-line messages)}."""
    global _CASES
    modules, failures = load_modules(list(extra_paths), skip_package)
    _CASES, kernel_names, coverage_failures = collect(modules, capabilities)
    failures += coverage_failures
    if jobs > 1 and len(_CASES) > 1:
        # fork: the workers inherit the imported modules and _CASES (kernels do not pickle).
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            rows = pool.map(check_case, range(len(_CASES)), chunksize=1)
    else:
        rows = [check_case(i) for i in range(len(_CASES))]
    for row in rows:
        failures += [f"{row['module']} {row['label']!r} on sm_{row['capability']}: {r}" for r in row["reasons"]]
    return {"ok": not failures, "kernels": kernel_names, "cases": rows, "failures": failures}


def print_table(report: dict) -> None:
    width = max([len(row["label"]) for row in report["cases"]] + [5])
    print(f"{'label':<{width}}  cc   shared   limit  regs  verdict")
    for row in report["cases"]:
        verdict = "ok" if not row["reasons"] else "FAIL"
        shared = "-" if row["shared"] is None else row["shared"]
        registers = "-" if row["registers"] is None else row["registers"]
        print(f"{row['label']:<{width}}  {row['capability']:<3} {shared:>7} {row['limit']:>7} {registers:>5}  "
              f"{verdict}")
    for failure in report["failures"]:
        print(f"FAIL {failure}")
    print(f"{len(report['cases'])} cases, {len(report['kernels'])} kernels, {len(report['failures'])} failures")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_layers.gate", description=__doc__.splitlines()[0])
    parser.add_argument("--capability", type=int, action="append", choices=CAPABILITIES,
                        help="check only this capability (repeatable; default: all)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--extra-module", action="append", default=[], metavar="PATH",
                        help="also check the kernels of this Python file (repeatable)")
    parser.add_argument("--skip-package", action="store_true", help="check only the --extra-module files")
    parser.add_argument("--jobs", type=int, default=2, help="compile worker processes")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # before any kernel module is imported: kernels must compile
    report = run_gate(args.capability or list(CAPABILITIES), args.extra_module, args.skip_package, args.jobs)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_table(report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
