"""Shared by the hot-experts tests and their device check (no pytest here: the device host may lack it)."""

from __future__ import annotations

import torch

from hybrid.hot_experts import SwapPolicy
from hybrid.routed_experts import RoutedExperts


class EverySwap(SwapPolicy):
    """Forces one swap per layer per decision whatever the counts: the coldest resident (lowest id on ties) for the
    absent expert after the last one admitted, round-robin."""

    def swaps(self, scores, resident):
        absent = [e for e in range(len(scores)) if e not in set(resident)]
        return [(min(resident), absent[len(resident) % len(absent)])]


def check_slot_table(module: RoutedExperts) -> None:
    """No expert both resident and absent: the slots hold exactly gpu_expert_ids, the table points at them, and
    the CPU side gets exactly the other experts."""
    resident = [e for e in module.slot_experts if e >= 0]
    assert sorted(resident) == list(module.gpu_expert_ids) and len(set(resident)) == len(resident)
    table = module.local_slot.tolist()
    for expert in range(module.num_experts):
        want = module.slot_experts.index(expert) if expert in resident else -1
        assert table[expert] == want, (module.layer_idx, expert)
    ids = torch.arange(module.num_experts, device=module.local_slot.device).view(-1, 1)
    local, cpu_ids = (t.cpu() for t in module._split(ids))
    is_resident = torch.tensor([e in resident for e in range(module.num_experts)]).view(-1, 1)
    assert torch.equal(cpu_ids, torch.where(is_resident, -1, ids.cpu()))
    assert torch.equal(local >= 0, is_resident)


def decode_swapping(llm, prompts, max_tokens: int, **engine_options):
    """An engine over `llm` (hot experts on, every decision forced to swap: `EverySwap`) decodes `prompts` to
    `max_tokens`, the slot tables checked after every step -> (the engine, the requests' ids, steps run)."""
    from hybrid.engine import Engine

    llm.hot_experts.policy = EverySwap()
    engine = Engine(llm, **engine_options)
    ids = [engine.add_request(p, max_tokens=max_tokens, ignore_eos=True) for p in prompts]
    num_steps = 0
    while engine.has_work():
        engine.step()
        num_steps += 1
        for module in llm.model.modules():
            if isinstance(module, RoutedExperts):
                check_slot_table(module)
    return engine, ids, num_steps
