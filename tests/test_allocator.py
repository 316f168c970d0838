"""Allocator invariants under random allocate / append / fork / free sequences (a hypothesis state
machine)."""

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tinykv.blocks import HOT, STORE, PoolExhausted
from tinykv.cache import make_cache
from tinykv.model import Config
from tinykv.spec import KVSpec

CFG = Config(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32)


def has_sequences(machine: "CacheMachine") -> bool:
    return bool(machine.truth)


class CacheMachine(RuleBasedStateMachine):
    """Tokens are written as K = V = token id, so every slot says which token it holds."""

    def __init__(self):
        super().__init__()
        self.cache = make_cache(CFG, KVSpec.parse("fp32"), blocks=24, block_size=4, max_seqs=4)
        self.truth: dict[int, list[int]] = {}
        self.next_id = 0

    def _append(self, sid, toks):
        """Write toks to sequence sid through a plan, as the model would."""
        plan = self.cache.plan([sid], [toks])
        kv = torch.tensor(toks, dtype=torch.float32)[:, None, None].expand(-1, 1, CFG.head_dim)
        self.cache.pools.write(0, kv, kv, plan.slots)
        self.cache.commit(plan)
        self.truth[sid] = self.truth[sid] + toks

    @rule(n=st.integers(1, 9), prefix=st.booleans())
    def new_seq(self, n, prefix):
        sid, self.next_id = self.next_id, self.next_id + 1
        toks = list(range(1, n + 1)) if prefix else [100 + sid] * n
        matched = self.cache.add_sequence(sid, toks)
        self.truth[sid] = toks[:matched]
        try:
            self._append(sid, toks[matched:])
        except PoolExhausted:
            self.cache.free(sid)
            del self.truth[sid]

    @precondition(has_sequences)
    @rule(data=st.data(), n=st.integers(1, 6))
    def append(self, data, n):
        sid = data.draw(st.sampled_from(sorted(self.truth)))
        try:
            self._append(sid, [200 + sid] * n)
        except PoolExhausted:
            pass

    @precondition(has_sequences)
    @rule(data=st.data())
    def fork(self, data):
        src = data.draw(st.sampled_from(sorted(self.truth)))
        dst, self.next_id = self.next_id, self.next_id + 1
        self.cache.fork(src, dst)
        self.truth[dst] = list(self.truth[src])

    @precondition(has_sequences)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.truth)))
        self.cache.free(sid)
        del self.truth[sid]

    @invariant()
    def refcounts_match_tables(self):
        for pool in (STORE, HOT):
            counts = [0] * len(self.cache.tables.alloc[pool].ref)
            for s in self.cache.tables.seqs.values():
                for where, b in s.blocks:
                    if where == pool:
                        counts[b] += 1
            assert counts == self.cache.tables.alloc[pool].ref
            free = set(self.cache.tables.alloc[pool].free)
            assert all((c == 0) == (b in free) for b, c in enumerate(counts))

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        data = self.cache.pools.groups[0].k.data[0]  # (NB, H, BS, D)
        for sid, toks in self.truth.items():
            s = self.cache.tables.seqs[sid]
            assert s.tokens == toks
            for i, t in enumerate(toks):
                pool, b = s.blocks[i // 4]
                src = data if pool == STORE else self.cache.pools.hot[0, 0]
                assert src[b, 0, i % 4, 0].item() == t

    def teardown(self):
        for sid in list(self.truth):
            self.cache.free(sid)
        assert self.cache.blocks_free == self.cache.num_blocks  # no leak


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
