"""NUMA discovery from a fake sysfs tree, cpulist parsing, CPU partitions, tensor-parallel ranks' shares of the
nodes and split_dim."""

import os

import pytest

from cpu_experts.topology import (
    NumaNode,
    Partition,
    discover_nodes,
    make_partitions,
    node_cpus,
    parse_cpulist,
    physical_cores,
    pin_current_thread,
    pinned_thread,
    rank_cpus,
    rank_nodes,
    split_dim,
    thread_cpus,
)

linux_affinity = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs os.sched_getaffinity")


def _fake_sysfs(root, cpulists):
    for name, text in cpulists.items():
        (root / name).mkdir()
        (root / name / "cpulist").write_text(text)
    (root / "online").write_text("0-2\n")  # a sibling file that is not a node
    return root


def test_parse_cpulist_formats():
    assert parse_cpulist("0-3,8-11\n") == (0, 1, 2, 3, 8, 9, 10, 11)
    assert parse_cpulist("5") == (5,)
    assert parse_cpulist("\n") == () and parse_cpulist("") == ()
    assert parse_cpulist(" 7, 2-3 ,2") == (2, 3, 7)  # sorted, duplicates merged
    assert parse_cpulist("0-0") == (0,)


@pytest.mark.parametrize("text", ["0-", "a-b", "3-1", "0,,x", "1-2-3", "-1"])
def test_parse_cpulist_rejects_malformed(text):
    with pytest.raises(ValueError, match="malformed cpulist"):
        parse_cpulist(text)


def test_discover_nodes_reads_sysfs_and_drops_empty_nodes(tmp_path):
    sysfs = _fake_sysfs(tmp_path, {"node0": "0-3\n", "node1": "4-7\n", "node2": "\n", "node10": "8\n"})
    nodes = discover_nodes(sysfs, allowed=range(16))
    assert nodes == [NumaNode(0, (0, 1, 2, 3)), NumaNode(1, (4, 5, 6, 7)), NumaNode(10, (8,))]


def test_discover_nodes_keeps_only_allowed_cpus(tmp_path):
    sysfs = _fake_sysfs(tmp_path, {"node0": "0-3", "node1": "4-7"})
    assert discover_nodes(sysfs, allowed={1, 2}) == [NumaNode(0, (1, 2))]
    assert discover_nodes(sysfs, allowed={3, 4}) == [NumaNode(0, (3,)), NumaNode(1, (4,))]


@linux_affinity
def test_discover_nodes_defaults_to_process_affinity(tmp_path):
    sysfs = _fake_sysfs(tmp_path, {"node0": "0-4095"})
    expected = tuple(sorted(os.sched_getaffinity(0)))
    assert discover_nodes(sysfs) == [NumaNode(0, expected)]


def test_discover_nodes_without_numa_info_is_one_node(tmp_path):
    assert discover_nodes(tmp_path / "missing", allowed=[3, 1]) == [NumaNode(0, (1, 3))]
    assert discover_nodes(tmp_path, allowed=[0, 1]) == [NumaNode(0, (0, 1))]  # exists but holds no nodes


def test_discover_nodes_malformed_cpulist_names_the_file(tmp_path):
    sysfs = _fake_sysfs(tmp_path, {"node0": "0-3", "node1": "4-x"})
    with pytest.raises(ValueError, match=r"node1.cpulist: malformed cpulist '4-x'"):
        discover_nodes(sysfs, allowed=range(8))


NODES = [NumaNode(0, (0, 1, 2, 3)), NumaNode(1, (4, 5, 6, 7))]


def test_make_partitions_per_node():
    expected = [Partition(0, 0, (0, 1, 2, 3)), Partition(1, 1, (4, 5, 6, 7))]
    assert make_partitions(NODES) == expected
    assert make_partitions(NODES, 2) == expected


def test_make_partitions_forced_counts():
    assert make_partitions(NODES, 1) == [Partition(0, 0, tuple(range(8)))]
    three = make_partitions(NODES, 3)
    assert [p.cpus for p in three] == [(0, 1, 2), (3, 4, 5), (6, 7)]
    assert [p.node for p in three] == [0, 0, 1]  # node of each group's first CPU
    assert make_partitions([NumaNode(0, (0, 1, 2, 3))], 2) == [Partition(0, 0, (0, 1)), Partition(1, 0, (2, 3))]


def test_make_partitions_more_partitions_than_cpus_share_round_robin():
    parts = make_partitions([NumaNode(0, (0,)), NumaNode(1, (5, 6))], 5)
    assert [p.cpus for p in parts] == [(0,), (5,), (6,), (0,), (5,)]
    assert [p.node for p in parts] == [0, 1, 1, 0, 1]
    assert [p.index for p in parts] == list(range(5))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_make_partitions_rejects_invalid_count(bad):
    with pytest.raises(ValueError, match="numa_partitions"):
        make_partitions(NODES, bad)


def test_make_partitions_needs_nodes():
    with pytest.raises(ValueError, match="at least one NUMA node"):
        make_partitions([])


def _nodes(num_nodes: int, cpus_per_node: int) -> list[NumaNode]:
    return [NumaNode(n, tuple(range(n * cpus_per_node, (n + 1) * cpus_per_node))) for n in range(num_nodes)]


@pytest.mark.parametrize("num_nodes", [1, 2, 4])
@pytest.mark.parametrize("num_ranks", [2, 3])
def test_rank_nodes_are_disjoint_and_cover_the_machine(num_nodes, num_ranks):
    """Each rank its own CPUs, every CPU some rank's; whole nodes (each rank the same count) where there are at
    least as many nodes as ranks, else a contiguous share of every node."""
    nodes = _nodes(num_nodes, 8)
    shares = [rank_nodes(nodes, r, num_ranks) for r in range(num_ranks)]
    cpus = [node_cpus(share) for share in shares]
    assert sorted(c for rank in cpus for c in rank) == list(range(8 * num_nodes))  # disjoint, covering
    if num_nodes >= num_ranks:
        assert all(node in nodes for share in shares for node in share)  # whole nodes
        assert [[n.id for n in share] for share in shares] == [list(range(r, num_nodes, num_ranks))
                                                               for r in range(num_ranks)]
    else:
        assert all([n.id for n in share] == list(range(num_nodes)) for share in shares)  # a part of every node
        for share in shares:
            assert all(n.cpus == tuple(range(n.cpus[0], n.cpus[-1] + 1)) for n in share)  # contiguous
        assert max(map(len, cpus)) - min(map(len, cpus)) <= num_nodes
    assert [len(make_partitions(share)) for share in shares] == [len(share) for share in shares]  # one per node
    assert rank_nodes(nodes) == nodes


def test_rank_nodes_on_fewer_cpus_than_ranks_share_round_robin():
    """tp=3 on a 2-CPU machine (the CI's): every rank still has a CPU."""
    nodes = [NumaNode(0, (4, 9))]
    assert [node_cpus(rank_nodes(nodes, r, 3)) for r in range(3)] == [(4,), (9,), (4,)]
    assert [node_cpus(rank_nodes(_nodes(2, 2), r, 2)) for r in range(2)] == [(0, 1), (2, 3)]


@pytest.mark.parametrize("nodes", [_nodes(1, 32), _nodes(2, 16), _nodes(4, 4), _nodes(1, 8)], ids=str)
@pytest.mark.parametrize("num_ranks", [2, 4])
def test_rank_cpus_keep_one_cpu_of_each_share_for_the_host_threads(nodes, num_ranks):
    """On CUDA each rank's kernel threads leave the last CPU of its share to its host threads (the thread that
    steps it, gloo's, NCCL's): the ranks' CPU sets are disjoint, kernels and host are disjoint within a rank, and
    together they are the rank's share; without a host CPU asked for, both are the whole share."""
    ranks = [rank_cpus(nodes, r, num_ranks) for r in range(num_ranks)]
    every = [c for r in ranks for c in r.kernels + r.host]
    assert sorted(every) == sorted(node_cpus(nodes))  # disjoint over the ranks, covering the machine
    for rank, cpus in enumerate(ranks):
        assert len(cpus.host) == 1 and cpus.host[0] not in cpus.kernels and cpus.kernels
        assert set(cpus.kernels + cpus.host) == set(node_cpus(list(cpus.nodes)))
        assert list(cpus.nodes) == rank_nodes(nodes, rank, num_ranks)
    alone = rank_cpus(nodes, 0, num_ranks, leave_host_cpu=False)
    assert alone.kernels == alone.host == node_cpus(rank_nodes(nodes, 0, num_ranks))
    one_cpu = rank_cpus([NumaNode(0, (4, 9))], 1, 2)  # a share of one CPU: kernels and host share it
    assert one_cpu.kernels == one_cpu.host == (9,)


@linux_affinity
def test_pinned_thread_restores_the_threads_cpus():
    before = thread_cpus()
    with pinned_thread(before[-1:]):
        assert thread_cpus() == before[-1:]
    assert thread_cpus() == before


@pytest.mark.parametrize("rank,num_ranks", [(2, 2), (-1, 2), (0, 0), (True, 2), (0, 1.5)])
def test_rank_nodes_rejects_bad_ranks(rank, num_ranks):
    with pytest.raises(ValueError, match="rank"):
        rank_nodes(NODES, rank, num_ranks)
    with pytest.raises(ValueError, match="at least one NUMA node"):
        rank_nodes([], 0, 1)


def _check_split(size, parts, align):
    slices = split_dim(size, parts, align)
    assert len(slices) == parts
    assert slices[0][0] == 0 and slices[-1][1] == size
    for (start, end), (next_start, _) in zip(slices, slices[1:], strict=False):
        assert start <= end == next_start
        assert end % align == 0 or end == size
    assert slices[-1][0] <= slices[-1][1]
    seen_empty = False
    for start, end in slices:
        if start == end:
            seen_empty = True
        else:
            assert not seen_empty, f"non-empty slice after an empty one: {slices}"
    return slices


def test_split_dim_properties_over_many_shapes():
    for size in list(range(0, 70)) + [127, 128, 129, 1000, 14336, 18432]:
        for parts in range(1, 9):
            for align in (1, 2, 3, 8, 16, 32, 64, 128):
                slices = _check_split(size, parts, align)
                lengths = [end - start for start, end in slices]
                if size // align >= parts:
                    # Balanced: slices differ by at most one block plus the tail the last slice takes.
                    assert max(lengths) - min(lengths) <= align + size % align
                    assert min(lengths) > 0


def test_split_dim_examples():
    assert split_dim(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert split_dim(100, 3, 16) == [(0, 32), (32, 64), (64, 100)]
    assert split_dim(10, 4, 8) == [(0, 8), (8, 10), (10, 10), (10, 10)]
    assert split_dim(0, 3, 4) == [(0, 0), (0, 0), (0, 0)]
    assert split_dim(7, 1, 4) == [(0, 7)]


def test_split_dim_rejects_bad_arguments():
    for args in ((-1, 2, 1), (4, 0, 1), (4, 2, 0)):
        with pytest.raises(ValueError, match="split_dim"):
            split_dim(*args)


@linux_affinity
def test_pin_current_thread_is_safe():
    before = os.sched_getaffinity(0)
    try:
        assert pin_current_thread(sorted(before)[:1]) is True
        assert os.sched_getaffinity(0) == set(sorted(before)[:1])
    finally:
        os.sched_setaffinity(0, before)
    assert pin_current_thread(()) is False and pin_current_thread(None) is False
    assert pin_current_thread([10**6]) is False  # a CPU that does not exist: ignored, not raised
    assert os.sched_getaffinity(0) == before


def test_compile_cache_dropped_when_any_source_changes(tmp_path):
    """numba keys a cached kernel by its own file only; `compile_cache.refresh` drops the package's cache when any
    module changed (a caller's cache would otherwise keep a changed callee's old code)."""
    from cpu_experts import compile_cache

    (tmp_path / "kernels.py").write_text("A = 1\n")
    (tmp_path / "pool.py").write_text("B = 1\n")
    cache = tmp_path / "__pycache__"
    cache.mkdir()

    def fake_cache():
        for name in ("pool._serve-1.py311.nbi", "pool._serve-1.py311.1.nbc"):
            (cache / name).write_bytes(b"x")

    fake_cache()
    assert compile_cache.refresh(tmp_path) and not list(cache.glob("*.nb?"))  # no stamp: unknown sources
    fake_cache()
    assert not compile_cache.refresh(tmp_path) and len(list(cache.glob("*.nb?"))) == 2  # unchanged: kept
    (tmp_path / "kernels.py").write_text("A = 2\n")  # the callee only
    assert compile_cache.refresh(tmp_path) and not list(cache.glob("*.nb?"))
    assert not compile_cache.refresh(tmp_path)


def test_physical_cores_count_smt_siblings_once(tmp_path):
    """Two sockets' worth of sysfs: CPUs 0-3 are two cores with two threads each (core_cpus_list), CPU 4 an old
    kernel's thread_siblings_list, CPU 5 says nothing (its own core)."""
    for cpu, siblings, name in ((0, "0,2", "core_cpus_list"), (2, "0,2", "core_cpus_list"),
                                (1, "1,3", "core_cpus_list"), (3, "1,3", "core_cpus_list"),
                                (4, "4", "thread_siblings_list")):
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / name).write_text(siblings + "\n")
    assert physical_cores(range(6), tmp_path) == 4
    assert physical_cores((0, 2), tmp_path) == 1 and physical_cores((0, 1), tmp_path) == 2
    assert physical_cores(range(4)) >= 1  # this machine's own sysfs
