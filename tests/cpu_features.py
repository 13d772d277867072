"""`features(**changes)`: this CPU's `kernel_table.CpuFeatures` with some changed, to build an operator on the
kernels another CPU would run (`has_vnni=True`: the integer kernels' generic form here; AMX only where present)."""

from __future__ import annotations

import dataclasses

from cpu_experts.kernel_table import CpuFeatures


def features(**changes: bool) -> CpuFeatures:
    return dataclasses.replace(CpuFeatures.detect(), **changes)
