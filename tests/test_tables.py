"""Block tables (tables.py) and the offload policy (tiers.py), alone: plain Python over integers,
with a BlockData that records what it is asked to do. Every expectation is worked out by hand from
the block size and the tokens written."""

import pytest

from tinykv.blocks import DISK, HOST, HOT, STORE, PoolExhausted
from tinykv.tables import BlockTables, PlacedBlock


class Recorder:
    """A BlockData that holds no contents: it notes each copy and quantization asked of it."""

    def __init__(self):
        self.copies: list[tuple[int, int, int, int]] = []
        self.quantized: list[tuple[int, int]] = []

    def copy_block(self, src_tier: int, src: int, dst_tier: int, dst: int) -> None:
        self.copies.append((src_tier, src, dst_tier, dst))

    def quantize_hot(self, hot_block: int, store_block: int) -> None:
        self.quantized.append((hot_block, store_block))


def tables(num_blocks=8, n_hot=0, block_size=4, sink=0, residual=0, needs_tail=False,
           host_blocks=0, disk_blocks=0) -> BlockTables:
    return BlockTables(num_blocks=num_blocks, n_hot=n_hot, block_size=block_size, sink=sink,
                       residual=residual, needs_tail=needs_tail, data=Recorder(),
                       host_blocks=host_blocks, disk_blocks=disk_blocks)


def write(t: BlockTables, sid: int, tokens: list[int]) -> None:
    """One step of one sequence, committed."""
    t.assign([sid], [tokens])
    t.commit([sid])


def test_slots_follow_the_block_size():
    t = tables(block_size=4)
    t.add_sequence(0)
    t.add_sequence(1)
    slots = t.assign([0, 1], [[1] * 6, [2] * 3])
    store = slots.rows[STORE]
    # sequence 0: blocks 0 and 1 (offsets 0..3, 0..1); sequence 1: block 2 (offsets 0..2)
    assert store.token == list(range(9))
    assert store.block == [0, 0, 0, 0, 1, 1, 2, 2, 2]
    assert store.offset == [0, 1, 2, 3, 0, 1, 0, 1, 2]
    assert slots.rows[HOT].token == []
    assert slots.positions == [0, 1, 2, 3, 4, 5, 0, 1, 2] == slots.q_slots
    assert slots.q_seq == [0] * 6 + [1] * 3
    assert t.table_rows([0, 1], STORE) == [[0, 1], [2, -1]]
    assert t.placed([0, 1], (STORE,)) == [PlacedBlock(row=0, logical=0, tier=STORE, block=0),
                                          PlacedBlock(row=0, logical=1, tier=STORE, block=1),
                                          PlacedBlock(row=1, logical=0, tier=STORE, block=2)]


def test_full_blocks_of_a_known_prefix_are_shared():
    t = tables(block_size=4)
    prompt = list(range(10, 20))
    assert t.add_sequence(0, prompt) == 0
    write(t, 0, prompt)  # blocks 0, 1 full (hashed), block 2 half
    # the same first 9 tokens: two full blocks are found; the last token stays to be computed
    assert t.add_sequence(1, prompt[:9] + [99]) == 8
    assert t.seqs[1].blocks == [(STORE, 0), (STORE, 1)]
    assert t.alloc[STORE].ref[:3] == [2, 2, 1]
    # a prompt of exactly 8 tokens shares only the first block: one token must be fed
    assert t.add_sequence(2, prompt[:8]) == 4


def test_fork_copies_a_shared_block_on_its_first_write():
    t = tables(block_size=4)
    t.add_sequence(0)
    write(t, 0, [1] * 6)  # blocks 0 (full) and 1 (2 tokens)
    t.fork(0, 1)
    assert t.alloc[STORE].ref[:2] == [2, 2]
    t.assign([1], [[7]])  # into block 1, shared: copied first
    new = t.seqs[1].blocks[1][1]
    assert t.data.copies == [(STORE, 1, STORE, new)] and new not in (0, 1)
    assert t.seqs[0].blocks == [(STORE, 0), (STORE, 1)]
    ref = t.alloc[STORE].ref
    assert ref[0] == 2 and ref[1] == 1 and ref[new] == 1


def test_a_step_that_does_not_fit_changes_nothing():
    t = tables(num_blocks=2, block_size=4)
    t.add_sequence(0)
    with pytest.raises(PoolExhausted, match="needs 3 device blocks, 2 of 2 are free"):
        t.assign([0], [[1] * 9])
    assert t.free_blocks() == 2 and t.seqs[0].blocks == [] and t.seqs[0].tokens == []


def test_commit_quantizes_hot_blocks_that_left_the_residual_window():
    t = tables(num_blocks=8, n_hot=4, block_size=4, residual=4)
    t.add_sequence(0)
    t.assign([0], [[1] * 12])  # inside a residual window every block starts hot: 3 hot blocks
    assert [tier for tier, _ in t.seqs[0].blocks] == [HOT, HOT, HOT]
    t.commit([0])
    # blocks 0 and 1 hold tokens 0..7, out of the window (the last 4 tokens); block 2 stays hot
    assert t.data.quantized == [(0, 0), (1, 1)]
    assert t.seqs[0].blocks == [(STORE, 0), (STORE, 1), (HOT, 2)] and t.seqs[0].done == 2
    assert t.free_blocks(HOT) == 3


def test_sinks_stay_in_full_precision():
    t = tables(num_blocks=8, n_hot=4, block_size=4, sink=4)
    t.add_sequence(0)
    write(t, 0, [1] * 12)
    # block 0 holds the sinks: hot for good; blocks 1, 2 start in the store (no residual window)
    assert [tier for tier, _ in t.seqs[0].blocks] == [HOT, STORE, STORE]
    assert t.data.quantized == [] and t.seqs[0].done == 3


def test_rewrite_gives_fresh_slots_and_counts_the_evicted():
    t = tables(block_size=4)
    t.add_sequence(0)
    write(t, 0, list(range(10)))  # 3 blocks
    slots = t.rewrite(0, 4)  # keep 4 tokens: one fresh block, every old one freed
    assert slots.q_slots == [0, 1, 2, 3] and slots.rows[STORE].offset == [0, 1, 2, 3]
    st = t.seqs[0]
    assert st.tokens == list(range(10)) and st.evicted == 6 and st.slots == 4
    assert t.used_blocks() == 1 and len(st.blocks) == 1
    nxt = t.assign([0], [[10]])
    assert nxt.positions == [10] and nxt.q_slots == [4]  # RoPE positions run on; slots lag


def test_blocks_needed_bounds_a_step():
    t = tables(block_size=4)
    t.add_sequence(0)
    write(t, 0, [1] * 5)
    # 5 slots + 4 new: up to block 2 (3 blocks), of which block 0 is full: 2, plus a copy on write
    assert t.blocks_needed(0, 4) == 3
    assert t.blocks_needed(7, 4) == 2  # an unknown sequence: 1 block, plus one


def idle_and_running(t: BlockTables) -> None:
    """Sequences 0, 1, 2 of one full block each, run in that order."""
    for sid in (0, 1, 2):
        t.add_sequence(sid)
        write(t, sid, [sid] * 2)


def test_offload_moves_the_least_recently_run_sequence_first():
    t = tables(num_blocks=4, block_size=2, host_blocks=4)
    idle_and_running(t)  # 3 of 4 device blocks used
    t.add_sequence(3)
    t.assign([3], [[3] * 4])  # needs 2 blocks, 1 free: one block must move down
    assert t.seqs[0].blocks == [(HOST, 0)]  # sequence 0 ran longest ago
    assert t.seqs[1].blocks == [(STORE, 1)] and t.seqs[2].blocks == [(STORE, 2)]
    assert t.data.copies == [(STORE, 0, HOST, 0)]
    assert t.tiers.counts["blocks_device_to_host"] == 1


def test_a_full_host_tier_sends_its_oldest_block_to_disk():
    t = tables(num_blocks=4, block_size=2, host_blocks=1, disk_blocks=2)
    idle_and_running(t)
    t.add_sequence(3)
    t.assign([3], [[3] * 6])  # needs 3 blocks, 1 free: two move down
    # sequence 0's block went to the host first, then on to disk to make room for sequence 1's
    assert t.seqs[0].blocks == [(DISK, 0)] and t.seqs[1].blocks == [(HOST, 0)]
    assert t.data.copies == [(STORE, 0, HOST, 0), (HOST, 0, DISK, 0), (STORE, 1, HOST, 0)]


def test_swap_out_and_back_on_write():
    t = tables(num_blocks=4, block_size=2, host_blocks=4)
    t.add_sequence(0)
    write(t, 0, [1] * 3)  # a full block and a partial one
    assert t.tiers.swap_out(0)
    assert [tier for tier, _ in t.seqs[0].blocks] == [HOST, HOST] and t.free_blocks() == 4
    t.assign([0], [[2]])  # writes into the partial block: it comes back to the device
    assert t.seqs[0].blocks[0][0] == HOST and t.seqs[0].blocks[1][0] == STORE
    assert t.data.copies[-1][0] == HOST and t.data.copies[-1][2] == STORE
    no_host = tables()
    no_host.add_sequence(0)
    assert no_host.tiers.swap_out(0) is False  # no host tier to swap to


def test_every_tier_full_is_one_clear_error():
    t = tables(num_blocks=2, block_size=2, host_blocks=1)
    for sid in (0, 1):
        t.add_sequence(sid)
        write(t, sid, [sid] * 2)
    t.add_sequence(2)
    with pytest.raises(PoolExhausted, match="full on every tier"):
        t.assign([2], [[2] * 6])
