"""Per-step batch metadata: the one object passed into `model.forward` besides the token ids.

Tokens of all sequences in a step are concatenated ([T] = sum of query lengths). Sequence b owns tokens
query_start_loc[b]:query_start_loc[b+1], which are its positions seq_lens[b] - query_len .. seq_lens[b] - 1.
The KV cache is split into cache groups (`hybrid.cache_groups`), each with its own pages: in group g, sequence b's
KV lives in the pages listed in block_tables[g][b], and token t's new KV goes to slot slot_mappings[g][t]
(page * block_size + offset). An attention layer sees its own group's tables through `for_group`. Host copies of
the lengths let the reference paths loop without device syncs. A model with recurrent layers (Gated DeltaNet) gives
each sequence a state slot: `state_slots[b]` indexes the layers' state pools, and `has_initial_state[b]` says its
chunk resumes the sequence (num_computed > 0) rather than starting from zero states.

`StepInputs.prepare` is the one place a step's positions, slots and tables are computed (the slot formula lives in
`slot`): eager steps turn them into a `ForwardBatch`, CUDA-graph steps copy them into their static buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from hybrid.block_manager import NULL_PAGE


@dataclass(frozen=True)
class SequenceSlice:
    """One sequence's part of a step: `num_computed` tokens already in the cache, `num_new` run now, and its
    block table in each cache group."""

    num_computed: int
    num_new: int
    block_tables: Sequence[list[int]]
    state_slot: int = -1  # its recurrent-state slot (`hybrid.block_manager.StateSlotPool`), -1: none


def slot(block_table: list[int], position: int, block_size: int) -> int:
    """The flat KV-cache slot of `position` in a sequence with this block table."""
    page = block_table[position // block_size]
    if page == NULL_PAGE:
        raise ValueError(f"position {position} lies in a page released from its window")
    return page * block_size + position % block_size


@dataclass(frozen=True)
class StepInputs:
    """A step's inputs as host lists (what `ForwardBatch` and the graphs' static buffers are filled from)."""

    positions: list[int]
    slot_mappings: list[list[int]]  # per group, [T]
    block_tables: list[np.ndarray]  # per group, [B, max pages] int32, released pages and the padding as 0
    seq_lens: list[int]
    query_start_loc: list[int]
    state_slots: list[int] = field(default_factory=list)  # [B], -1 where a sequence has none
    has_initial_state: list[bool] = field(default_factory=list)  # [B]

    @classmethod
    def prepare(cls, seqs: Sequence[SequenceSlice], block_size: int) -> StepInputs:
        num_groups = len(seqs[0].block_tables)
        positions, starts, seq_lens = [], [0], []
        slots: list[list[int]] = [[] for _ in range(num_groups)]
        for seq in seqs:
            end = seq.num_computed + seq.num_new
            for table in seq.block_tables:
                if len(table) * block_size < end:
                    raise ValueError(f"block table of {len(table)} pages is too short for {end} tokens")
            positions += range(seq.num_computed, end)
            for group, table in enumerate(seq.block_tables):
                slots[group] += (slot(table, pos, block_size) for pos in range(seq.num_computed, end))
            starts.append(starts[-1] + seq.num_new)
            seq_lens.append(end)
        tables = [table_array([seq.block_tables[group] for seq in seqs]) for group in range(num_groups)]
        return cls(positions, slots, tables, seq_lens, starts, [seq.state_slot for seq in seqs],
                   [seq.num_computed > 0 for seq in seqs])

    @property
    def query_lens(self) -> list[int]:
        return [b - a for a, b in zip(self.query_start_loc, self.query_start_loc[1:], strict=False)]


def table_array(tables: Sequence[list[int]]) -> np.ndarray:
    """Ragged block tables -> [B, the longest's pages] int32, zero-padded. A released entry reads as page 0: in
    bounds, and the kernels never read a key before the window. Rows are filled from the lists by numpy: a long
    context's table (8192 pages at 128K) built per step in Python costs milliseconds."""
    array = np.zeros((len(tables), max(map(len, tables), default=0)), dtype=np.int32)
    for row, table in zip(array, tables, strict=True):
        row[:len(table)] = table
    return np.maximum(array, 0, out=array)


@dataclass
class ForwardBatch:
    positions: torch.Tensor  # [T] int64
    slot_mappings: tuple[torch.Tensor, ...]  # per cache group, [T] int64
    block_tables_by_group: tuple[torch.Tensor, ...]  # per cache group, [B, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [B] int32: context length after this step
    query_start_loc: torch.Tensor  # [B + 1] int32
    block_size: int
    seq_lens_cpu: list[int]
    query_lens_cpu: list[int]
    group: int = 0  # the cache group whose tables `slot_mapping` and `block_tables` are
    state_slots: torch.Tensor | None = None  # [B] int32, recurrent-state slot per sequence (-1: none)
    has_initial_state: torch.Tensor | None = None  # [B] bool: the chunk resumes its sequence's states
    state_slots_cpu: list[int] = field(default_factory=list)
    has_initial_state_cpu: list[bool] = field(default_factory=list)
    _views: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.slot_mappings[self.group]

    @property
    def block_tables(self) -> torch.Tensor:
        return self.block_tables_by_group[self.group]

    def for_group(self, group: int) -> ForwardBatch:
        """The step as the layers of cache group `group` see it (one view per group and step, made once)."""
        if group == self.group:
            return self
        view = self._views.get(group)
        if view is None:
            view = self._views[group] = replace(self, group=group)
        return view

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_cpu)

    def token_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token of the step: its sequence (block-table row) and how many context tokens it sees (its position
        + 1), both [T] int32: the rows of DSA's indexer and sparse attention. Computed on the device without a sync,
        and not cached: a graph's warm-up and capture run the same batch object, and the replay must recompute."""
        num_seqs = self.num_seqs
        seq_ids = torch.arange(num_seqs, dtype=torch.int32, device=self.positions.device)
        if self.num_tokens != num_seqs:  # else one token per sequence: row b is sequence b
            seq_ids = torch.repeat_interleave(seq_ids, self.query_start_loc.diff(), output_size=self.num_tokens)
        return seq_ids, (self.positions + 1).to(torch.int32)

    def last_token_indices(self) -> torch.Tensor:
        """[B] index of each sequence's last token in the flattened step (where its next token is sampled)."""
        return self.query_start_loc[1:].long() - 1

    @classmethod
    def from_inputs(cls, inputs: StepInputs, block_size: int, device: torch.device | str) -> ForwardBatch:
        def ints(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        has_slots = any(slot >= 0 for slot in inputs.state_slots)
        return cls(
            positions=ints(inputs.positions, torch.int64),
            slot_mappings=tuple(ints(s, torch.int64) for s in inputs.slot_mappings),
            block_tables_by_group=tuple(torch.from_numpy(t).to(device) for t in inputs.block_tables),
            seq_lens=ints(inputs.seq_lens, torch.int32),
            query_start_loc=ints(inputs.query_start_loc, torch.int32),
            block_size=block_size,
            seq_lens_cpu=inputs.seq_lens,
            query_lens_cpu=inputs.query_lens,
            # on the device only where a sequence holds a slot (a model with recurrent layers)
            state_slots=ints(inputs.state_slots, torch.int32) if has_slots else None,
            has_initial_state=ints(inputs.has_initial_state, torch.bool) if has_slots else None,
            state_slots_cpu=inputs.state_slots,
            has_initial_state_cpu=inputs.has_initial_state,
        )

    @classmethod
    def build(cls, seqs: Sequence[SequenceSlice], block_size: int, device: torch.device | str) -> ForwardBatch:
        return cls.from_inputs(StepInputs.prepare(seqs, block_size), block_size, device)
