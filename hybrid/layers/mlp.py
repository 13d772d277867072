"""SiLU-gated MLP: down(silu(gate(x)) * up(x)). Used for dense layers and shared experts.

With the kernels' ops (`DenseOps.is_fused_gate_up`), `fuse_gate_up` (called once after loading) puts gate and up in
one [2I, H] weight whose halves the two Linear weights then view, so one matmul feeds `silu_and_mul`. Projections
that keep quantized weights (`QuantizedLinear`, placed by the loader) stay two GEMMs."""

import torch
import torch.nn.functional as F
from torch import nn

from hybrid import parallel
from hybrid.layers.ops import TORCH_OPS, DenseOps


class GatedMLP(nn.Module):
    """Tensor parallel: gate and up column-parallel, down row-parallel; `is_reduced` False leaves the partial sum
    to the owner's one all-reduce (a shared expert, summed with the routed experts' partial first)."""

    def __init__(self, hidden_size: int, intermediate_size: int, ops: DenseOps = TORCH_OPS, is_reduced: bool = True):
        super().__init__()
        self.tp = parallel.current()
        self.is_reduced = is_reduced
        if self.tp.size > 1:
            parallel.check_divisible("MLP intermediate size", intermediate_size, self.tp)
            intermediate_size //= self.tp.size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.ops = ops
        self.gate_up_weight: torch.Tensor | None = None

    def tp_shards(self) -> dict[str, parallel.Shard]:
        return {"gate_proj.weight": parallel.COLUMN, "up_proj.weight": parallel.COLUMN,
                "down_proj.weight": parallel.ROW}

    def fuse_gate_up(self) -> None:
        is_plain = isinstance(self.gate_proj, nn.Linear) and isinstance(self.up_proj, nn.Linear)
        if not self.ops.is_fused_gate_up or self.gate_up_weight is not None or not is_plain:
            return
        fused = torch.cat((self.gate_proj.weight.data, self.up_proj.weight.data))  # [2I, H]
        inter = self.gate_proj.weight.shape[0]
        self.gate_proj.weight.data, self.up_proj.weight.data = fused[:inter], fused[inter:]
        self.gate_up_weight = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None:
            out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        else:
            gate_up = F.linear(x, self.gate_up_weight)  # [T, 2I]
            out = self.down_proj(self.ops.silu_and_mul(gate_up))
        return parallel.all_reduce(out, self.tp) if self.is_reduced else out
