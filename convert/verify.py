"""`hybrid-convert verify DST [--source SRC]`: re-checks every file against the manifest's size and sha256 and,
given the source checkpoint, measures each MoE layer's expert quantization error (relative RMS: the RMS of
dequantized minus source weights over the RMS of the source weights, per projection role). An error that is NaN
or inf (NaN or inf in the experts or the source) fails the check."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from convert.plan import ROLES, build_plan
from cpu_experts.expert_file import ExpertLayerSpec
from hybrid.converted import MANIFEST_FILE, ConvertedExperts, read_manifest
from hybrid.errors import CheckpointError
from hybrid.safetensors_io import sha256_file


@dataclass
class VerifyReport:
    num_files: int = 0
    problems: list[str] = field(default_factory=list)  # files that fail their checksum
    expert_error: dict[int, dict[str, float]] = field(default_factory=dict)  # layer -> role -> relative RMS

    @property
    def nonfinite_errors(self) -> list[str]:
        """One line per expert error that is NaN or inf (a comparison with it would pass)."""
        return [f"layer {layer} {role}: the experts' relative RMS error is {value} (NaN or inf in the converted "
                "experts or in the source)"
                for layer, errors in self.expert_error.items() for role, value in errors.items()
                if not math.isfinite(value)]

    @property
    def ok(self) -> bool:
        return not self.problems and not self.nonfinite_errors


def verify_checksums(dst: Path, manifest: dict, progress: bool | None = False) -> list[str]:
    problems = []
    for entry in tqdm(manifest.get("files") or [], desc="checksums", unit="file",
                      disable=None if progress is None else not progress):
        path = dst / entry["path"]
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.stat().st_size != entry.get("size"):
            problems.append(f"{path}: size {path.stat().st_size} differs from the manifest's {entry.get('size')}")
        elif sha256_file(path) != entry.get("sha256"):
            problems.append(f"{path}: sha256 differs from the manifest")
    return problems


def verify(dst: str | Path, source: str | Path | None = None, progress: bool | None = None) -> VerifyReport:
    dst = Path(dst)
    manifest = read_manifest(dst)
    if manifest is None:
        raise CheckpointError(f"{dst}: no {MANIFEST_FILE}: not a finished hybrid-convert output (an interrupted "
                              "conversion resumes when the same command is run again)")
    report = VerifyReport(num_files=len(manifest.get("files") or []))
    report.problems = verify_checksums(dst, manifest, progress)
    if source is not None and report.ok:
        report.expert_error = expert_errors(dst, Path(source), progress)
    return report


def expert_errors(dst: Path, source: Path, progress: bool | None = None) -> dict[int, dict[str, float]]:
    """Per MoE layer and role, the relative RMS error of the converted experts against the source's."""
    plan = build_plan(source)
    # the expert files alone: the GPU weights may be quantized (--gpu-quant), which the source's model is not
    experts = ConvertedExperts(dst, read_manifest(dst), plan.model)
    names = experts.names()
    config = plan.config
    layers = [i for i in range(config.num_layers) if config.moe_layers[i]]
    spec = ExpertLayerSpec(config.moe.num_experts, config.hidden_size, config.moe.intermediate_size, "bf16", 0)
    out = {}
    for layer in tqdm(layers, desc="expert error", unit="layer", disable=None if progress is None else not progress):
        fused = plan.fused.get(layer)
        sums = {role: [0.0, 0.0] for role in ROLES}  # role -> [sum of squared errors, sum of squared source values]
        for expert in range(config.moe.num_experts):
            # gpt-oss, Qwen3.5: the expert's rows of the layer's fused tensors, read once for its three roles
            source_weights = fused.float_weights(plan.ckpt, expert, spec) if fused is not None else {}
            for role in ROLES:
                name = plan.expert_name(layer, expert, role)
                if name not in names:
                    raise CheckpointError(f"{dst}: no converted expert '{name}': is {source} its source?")
                want = source_weights[role] if fused is not None else plan.ckpt.read(name).float()
                got = experts.read(name).float()
                if got.shape != want.shape:
                    raise CheckpointError(f"{dst}: '{name}' has shape {tuple(got.shape)}, the source has "
                                          f"{tuple(want.shape)}")
                sums[role][0] += float((got - want).pow(2).sum())
                sums[role][1] += float(want.pow(2).sum())
        out[layer] = {role: math.sqrt(err / ref) if ref > 0 else math.sqrt(err) for role, (err, ref) in sums.items()}
    return out
