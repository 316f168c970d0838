"""Generation: sampling, and a continuous-batching engine over the paged KV cache.

Every request is a list of known tokens (prompt + generated so far) of which the first `cached`
are in the cache. One engine step feeds each running request its next uncached tokens (a prefill
chunk, or the one token sampled last step), runs the model once over the packed batch, and
samples where a request has consumed all its known tokens. Prefill and decode are the same step;
a finished request leaves and a waiting one joins between steps. When the block pool runs dry,
the newest request is preempted: its blocks are freed and it is recomputed later.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .blocks import STORE, PoolExhausted
from .cache import PagedKVCache, Plan
from .model import Config, Transformer
from .spec import KVSpec


class NumericsError(RuntimeError):
    """The output is meaningless (NaN or inf logits)."""


@dataclass
class Sampling:
    temperature: float = 0.8
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 128
    seed: int | None = None


def sample(logits: torch.Tensor, s: Sampling, gen: torch.Generator | None) -> int:
    """One token from a (V,) row of logits: greedy at temperature 0, else top-k / top-p sampling."""
    if s.temperature <= 0:
        return int(torch.argmax(logits))
    # From the largest logit down, in float64: a tiny temperature then sends the others to -inf
    # (probability 0) instead of overflowing every logit to inf (a NaN softmax).
    logits = (logits.double() - logits.max()) / s.temperature
    if s.top_k > 0:
        kth = torch.topk(logits, min(s.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if s.top_p < 1.0:
        sorted_probs, idx = torch.sort(probs, descending=True)
        # keep the smallest set whose mass reaches top_p
        drop = torch.cumsum(sorted_probs, 0) - sorted_probs > s.top_p
        probs = torch.zeros_like(probs).scatter(0, idx, sorted_probs.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


@dataclass
class Request:
    rid: int
    prompt_len: int
    tokens: list[int]
    sampling: Sampling
    n: int = 1  # samples wanted: forked from this request once its prompt is in the cache
    cached: int = 0
    gen: torch.Generator | None = None
    finish: str | None = None
    parent: int | None = None  # the request this sample was forked from (n > 1)

    @property
    def new_ids(self) -> list[int]:
        return self.tokens[self.prompt_len:]


@dataclass
class Stats:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0
    preemptions: int = 0


class Engine:
    def __init__(self, model: Transformer, cache: PagedKVCache, eos_ids: set[int] | None = None,
                 max_batch: int = 16, prefill_chunk: int = 512):
        if max_batch < 1 or prefill_chunk < 1:
            raise ValueError(f"max_batch ({max_batch}) and prefill_chunk ({prefill_chunk}) "
                             "must be >= 1")
        self.model, self.cache = model, cache
        self.eos_ids = eos_ids or set()
        # A prefill chunk must fit in the device pool beside the other sequences' tails: half the
        # pool, or (without a tier to evict to) whatever is free when the step starts (step()).
        self.max_batch, self.prefill_chunk = max_batch, prefill_chunk
        self.chunk = min(prefill_chunk, max(1, cache.num_blocks // 2) * cache.bs)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}
        self.stats = Stats()
        self._next_id = 0

    def add(self, prompt: list[int], sampling: Sampling, n: int = 1) -> int:
        limit = self.model.cfg.max_seq_len
        if not prompt:
            raise ValueError("empty prompt")
        if len(prompt) >= limit:
            raise ValueError(f"prompt has {len(prompt)} tokens; the model's context is {limit}")
        rid = self._new_request(list(prompt), len(prompt), sampling, n)
        self.waiting.append(self.requests[rid])
        return rid

    def _new_request(self, tokens: list[int], prompt_len: int, sampling: Sampling,
                     n: int = 1) -> int:
        rid, self._next_id = self._next_id, self._next_id + 1
        gen = None
        if sampling.seed is not None:
            gen = torch.Generator().manual_seed(sampling.seed + rid)
        self.requests[rid] = Request(rid=rid, prompt_len=prompt_len, tokens=tokens,
                                     sampling=sampling, n=n, gen=gen)
        return rid

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            r = self.waiting[0]
            need = self.cache.tables.blocks_needed(r.rid, len(r.tokens))
            if self.running and need > self.cache.tables.free_everywhere():
                break  # wait for running requests to finish and free blocks
            self.waiting.popleft()
            if r.rid not in self.cache.tables.seqs:  # new, or preempted and not swapped
                r.cached = self.cache.add_sequence(r.rid, r.tokens)
            self.running.append(r)

    def _preempt(self, swap: bool) -> None:
        r = self.running.pop()  # the newest
        if not (swap and self.cache.tables.tiers.swap_out(r.rid)):
            self.cache.free(r.rid)  # no tier to swap to: recompute it later
            r.cached = 0
        self.waiting.appendleft(r)
        self.stats.preemptions += 1

    def step(self) -> list[tuple[int, int]]:
        """One model step over all running requests: schedule, forward, sample, account. Returns
        the (request id, token) pairs sampled."""
        self._admit()
        t0 = time.perf_counter()
        scheduled = self._schedule()
        if scheduled is None:
            return []
        plan, feed, done = scheduled
        logits = self._forward(plan, feed)  # (len(done), V)
        for r, toks in zip(self.running, feed):
            r.cached += len(toks)
        out = self._sample(logits, done)
        self._account(feed, time.perf_counter() - t0)
        return out

    def _schedule(self) -> tuple[Plan, list[list[int]], list[int]] | None:
        """The cache's plan for the running requests' next tokens, those tokens, and the rows of
        the requests that sample after them. While the pool cannot hold the step, the newest
        request is preempted. None when nothing runs."""
        while self.running:
            feed = self._feed()
            done = [i for i, (r, t) in enumerate(zip(self.running, feed))
                    if r.cached + len(t) == len(r.tokens)]
            try:
                plan = self.cache.plan([r.rid for r in self.running], feed, logits=done)
                return plan, feed, done
            except PoolExhausted as e:
                if len(self.running) == 1:
                    raise
                self._preempt(swap=e.pool == STORE)  # plan() allocates nothing when it fails
        return None

    def _feed(self) -> list[list[int]]:
        """Each running request's next uncached tokens (a prefill chunk, or the token sampled
        last step), within the step's token budget."""
        budget, feed = self.chunk, []
        if not self.cache.offload:  # a block kept back per running sequence, one for a partial
            free = self.cache.blocks_free - len(self.running) - 1
            budget = min(self.prefill_chunk, max(budget, free * self.cache.bs))
        for r in self.running:
            n = min(len(r.tokens) - r.cached, max(budget, 1))
            feed.append(r.tokens[r.cached:r.cached + n])
            budget -= n
        return feed

    def _forward(self, plan: Plan, feed: list[list[int]]) -> torch.Tensor:
        """The model over the step's packed tokens, then the cache's commit; NaN or inf is an
        error. Returns the logits of the rows the plan asked for."""
        tokens = torch.tensor(sum(feed, []), dtype=torch.long, device=plan.positions.device)
        logits = self.model(tokens, plan)
        self.cache.commit(plan)
        # Dynamic scales always fit finite values, so any count here is a NaN or a float format
        # overflowing to inf: attention over it is meaningless, whatever a kernel makes of it.
        overflowed = not self.cache.spec.needs_scales and self.cache.saturated > 0
        if overflowed or not _finite(logits):
            raise NumericsError("NaN/inf in the KV cache or the logits: the cache overflowed or "
                                "its scales are unusable (try fp32 or a wider spec, recalibrate)")
        return logits

    def _sample(self, logits: torch.Tensor, done: list[int]) -> list[tuple[int, int]]:
        """One token for each request that consumed all its known tokens (logits row by row of
        `done`); a request with n > 1 forks first."""
        out = []
        for row, i in enumerate(done):
            for child in self._fork(self.running[i]):
                tok = sample(logits[row], child.sampling, child.gen)
                child.tokens.append(tok)
                out.append((child.rid, tok))
                self._check_done(child, tok)
        return out

    def _account(self, feed: list[list[int]], seconds: float) -> None:
        """The step's tokens and time in the run's statistics; finished requests leave."""
        n_tok = sum(len(t) for t in feed)
        decoding = all(len(t) == 1 for t in feed) and self.stats.steps > 0
        if decoding:
            self.stats.decode_tokens += n_tok
            self.stats.decode_s += seconds
        else:
            self.stats.prefill_tokens += n_tok
            self.stats.prefill_s += seconds
        self.stats.steps += 1
        for r in [r for r in self.running if r.finish]:
            self.running.remove(r)
            self.cache.free(r.rid)

    def _fork(self, r: Request) -> list[Request]:
        """The first time a request with n > 1 samples, split it into n sequences sharing its
        blocks."""
        if r.n == 1:
            return [r]
        kids = [r]
        for _ in range(r.n - 1):
            cid = self._new_request(list(r.tokens), r.prompt_len, r.sampling)
            self.requests[cid].parent = r.rid
            self.cache.fork(r.rid, cid)
            child = self.requests[cid]
            child.cached = r.cached
            self.running.append(child)
            kids.append(child)
        r.n = 1
        return kids

    def _check_done(self, r: Request, tok: int) -> None:
        if tok in self.eos_ids:
            r.finish = "stop"
        elif (len(r.new_ids) >= r.sampling.max_new_tokens
              or len(r.tokens) >= self.model.cfg.max_seq_len):
            r.finish = "length"

    def run(self) -> Iterator[tuple[int, int]]:
        """Step until every request has finished, yielding (request id, token) as they come."""
        while self.waiting or self.running:
            yield from self.step()


SATURATION_WARN = 0.001  # the share of cached values clipped, overflowed or NaN that is reported


def saturation_warning(saturated: int, tokens: int, cfg: Config, spec: KVSpec) -> str | None:
    """What to tell the user when more than SATURATION_WARN of the values a cache stored for
    `tokens` tokens were clipped by static scales, overflowed a float format or were NaN; None
    when fewer were."""
    stored = tokens * 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim
    if not stored or saturated <= SATURATION_WARN * stored:
        return None
    if spec.needs_scales:
        why = "the static scales do not fit this input (recalibrate)"
    else:
        why = f"the values do not fit '{spec}' (try a wider spec, e.g. bf16 or fp32)"
    return (f"{saturated} of {stored} cached values ({100 * saturated / stored:.2f}%) were "
            f"clipped, overflowed or NaN: {why}")


def numerics_warning(eng: Engine) -> str | None:
    """saturation_warning for what the engine has stored so far (call it after prefill, and at
    the end)."""
    st = eng.stats
    return saturation_warning(eng.cache.saturated, st.prefill_tokens + st.decode_tokens,
                              eng.model.cfg, eng.cache.spec)


def generation_stats(eng: Engine) -> dict:
    """Speeds, cache memory and numerics of a finished run; `warnings` lists what the user must see
    (values clipped, overflowed or NaN past SATURATION_WARN)."""
    st, cache = eng.stats, eng.cache
    out = {
        "prefill_tokens_per_s": st.prefill_tokens / st.prefill_s if st.prefill_s else 0.0,
        "decode_tokens_per_s": st.decode_tokens / st.decode_s if st.decode_s else 0.0,
        "kv_spec": str(cache.spec), "kv_bytes_per_token": cache.bytes_per_token,
        "kv_pool_bytes": cache.nbytes, "blocks_used": cache.tables.peak_blocks,
        "blocks_total": cache.num_blocks, "hot_blocks_total": cache.n_hot,
        "preemptions": st.preemptions, "saturated_values": cache.saturated,
        "attention": cache.kernels.name, "warnings": [],
    }
    w = numerics_warning(eng)
    if w:
        out["warnings"].append(w)
    if cache.offload:
        offload = cache.offload_stats()
        moved = sum(v for k, v in offload.items() if k.startswith("bytes_"))
        offload["bytes_moved_per_token"] = moved / max(1, st.decode_tokens + st.prefill_tokens)
        out["offload"] = offload
    return out


def _finite(logits: torch.Tensor) -> bool:
    """Whether every logit is finite (this syncs, as sampling does anyway). Their sum is finite
    unless one is NaN or inf, or finite ones overflow it: only then is each one checked. The sum
    reads the logits once and makes no tensor of flags (isfinite().all(): bench profile's
    `rest` of every decode step)."""
    return math.isfinite(float(logits.sum())) or bool(logits.isfinite().all())
