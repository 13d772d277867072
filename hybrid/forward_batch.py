"""Per-step batch metadata: the one object passed into `model.forward` besides the token ids.

Tokens of all sequences in a step are concatenated ([T] = sum of query lengths). Sequence b owns tokens
query_start_loc[b]:query_start_loc[b+1], which are its positions seq_lens[b] - query_len .. seq_lens[b] - 1;
its KV lives in the pages listed in block_tables[b]; token t's new KV goes to slot slot_mapping[t]
(page * block_size + offset). Host copies of the lengths let the reference paths loop without device syncs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SequenceSlice:
    """One sequence's part of a step: `num_computed` tokens already in the cache, `num_new` run now."""

    num_computed: int
    num_new: int
    block_table: list[int]


@dataclass
class ForwardBatch:
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [B] int32: context length after this step
    query_start_loc: torch.Tensor  # [B + 1] int32
    block_size: int
    seq_lens_cpu: list[int]
    query_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_cpu)

    def last_token_indices(self) -> torch.Tensor:
        """[B] index of each sequence's last token in the flattened step (where its next token is sampled)."""
        return self.query_start_loc[1:].long() - 1

    @classmethod
    def build(cls, seqs: list[SequenceSlice], block_size: int, device: torch.device | str) -> ForwardBatch:
        positions, slots, starts = [], [], [0]
        for seq in seqs:
            end = seq.num_computed + seq.num_new
            if len(seq.block_table) * block_size < end:
                raise ValueError(f"block table of {len(seq.block_table)} pages is too short for {end} tokens")
            for pos in range(seq.num_computed, end):
                positions.append(pos)
                slots.append(seq.block_table[pos // block_size] * block_size + pos % block_size)
            starts.append(starts[-1] + seq.num_new)
        max_blocks = max(len(seq.block_table) for seq in seqs)
        tables = [seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq in seqs]
        seq_lens = [seq.num_computed + seq.num_new for seq in seqs]
        return cls(
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            block_size=block_size,
            seq_lens_cpu=seq_lens,
            query_lens_cpu=[seq.num_new for seq in seqs],
        )
