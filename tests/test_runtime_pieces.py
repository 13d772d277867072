"""Block manager pages, ForwardBatch construction and sampling."""

import pytest
import torch

from hybrid.block_manager import OutOfBlocks, PrefixCachingBlockManager, blocks_needed
from hybrid.forward_batch import ForwardBatch, SequenceSlice, table_array
from hybrid.sampling import SamplingParams, sample


def test_allocator_hands_out_and_takes_back():
    alloc = PrefixCachingBlockManager(4, 16)
    a = alloc.allocate(3)
    assert sorted(a) == [0, 1, 2] and alloc.num_free == 1
    with pytest.raises(OutOfBlocks, match="need 2 KV pages, 1 free of 4"):
        alloc.allocate(2)
    alloc.free(a)
    assert alloc.num_free == 4 and sorted(alloc.allocate(4)) == [0, 1, 2, 3]
    assert [blocks_needed(n, 16) for n in (1, 16, 17, 32)] == [1, 1, 2, 2]


def test_forward_batch_positions_and_slots_cross_pages():
    seqs = [SequenceSlice(3, 3, [[7, 2], [1, 3]]), SequenceSlice(0, 1, [[5], [-1]])]  # two cache groups
    with pytest.raises(ValueError, match="released from its window"):
        ForwardBatch.build(seqs, block_size=4, device="cpu")
    seqs[1] = SequenceSlice(0, 1, [[5], [0]])
    batch = ForwardBatch.build(seqs, block_size=4, device="cpu")
    assert batch.positions.tolist() == [3, 4, 5, 0]
    assert batch.slot_mapping.tolist() == [7 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 5 * 4]
    assert batch.query_start_loc.tolist() == [0, 3, 4] and batch.seq_lens.tolist() == [6, 1]
    assert batch.block_tables.tolist() == [[7, 2], [5, 0]]
    assert batch.last_token_indices().tolist() == [2, 3]
    second = batch.for_group(1)  # what a layer of cache group 1 sees: its own slots and tables, shared lengths
    assert second.slot_mapping.tolist() == [1 * 4 + 3, 3 * 4 + 0, 3 * 4 + 1, 0]
    assert second.block_tables.tolist() == [[1, 3], [0, 0]] and second.positions is batch.positions
    assert batch.for_group(1) is second and second.for_group(0).slot_mapping is batch.slot_mapping
    with pytest.raises(ValueError, match="too short"):
        ForwardBatch.build([SequenceSlice(4, 1, [[0]])], block_size=4, device="cpu")


def test_table_array_pads_and_reads_released_pages_as_zero():
    """Ragged tables to one int32 array: zero padding, a page released from its window (-1) read as page 0."""
    tables = [[-1, -1, 9, 4], [3], []]
    array = table_array(tables)
    assert array.dtype.name == "int32" and array.tolist() == [[0, 0, 9, 4], [3, 0, 0, 0], [0, 0, 0, 0]]
    assert tables[0] == [-1, -1, 9, 4]  # the block manager's lists untouched
    assert table_array([[], []]).shape == (2, 0)


def test_greedy_and_filters():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9], [5.0, 0.0, 0.0, 0.0]])
    assert sample(logits, SamplingParams(), None).tolist() == [1, 0]
    gen = torch.Generator().manual_seed(0)
    top1 = [sample(logits, SamplingParams(temperature=1.0, top_k=1), gen).tolist() for _ in range(20)]
    assert all(ids == [1, 0] for ids in top1)
    top_p = {tuple(sample(logits, SamplingParams(temperature=1.0, top_p=0.5), gen).tolist()) for _ in range(50)}
    assert top_p <= {(1, 0), (3, 0)} and len(top_p) == 2  # the two near-equal tokens share the top half
    min_p = {sample(logits, SamplingParams(temperature=1.0, min_p=0.5), gen)[0].item() for _ in range(50)}
    assert min_p == {1, 3}


def test_seeded_sampling_is_reproducible_and_validated():
    logits = torch.randn(3, 50)
    draw = lambda seed: sample(logits, SamplingParams(temperature=0.8), torch.Generator().manual_seed(seed)).tolist()
    assert draw(7) == draw(7)
    assert any(draw(7) != draw(s) for s in range(8, 12))
    for bad in ({"temperature": -1}, {"top_p": 0.0}, {"top_k": -2}, {"min_p": 1.5}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
