"""The passkey retrieval task (a needle in a haystack): does the model, reading through a KV cache
stored under a spec, recall a five-digit key hidden at some depth of a long filler text?

A prompt is an instruction, filler sentences with the needle ("The pass key is 68231. Remember it.
68231 is the pass key.") at the sentence boundary nearest `depth` of the filler's tokens (0 = before
the first sentence, 1 = after the last) and the question, in the model's chat template where it
has one (plain text for a base model), with the answer begun ("The pass key is") so that a small
model goes straight to the digits. Keys come from random.Random(seed), one per (length, depth,
trial) in that order: a run is reproducible and every spec sees the same prompts. All prompts go
through one continuous-batching Engine; the answer is a few greedy tokens, and a trial is found
when the key's digits appear in it.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from itertools import accumulate
from pathlib import Path

import torch
from tqdm import tqdm

from .cache import PagedKVCache, make_cache
from .generate import Engine, Sampling
from .model import Transformer
from .plots import pyplot, save_figure
from .spec import KVSpec
from .tokenizer import Tokenizer

# Short plain sentences with no digits, no number words and nothing about keys, so that nothing in
# the filler competes with the needle.
DEFAULT_FILLER = ("The snow is white. The night is dark. The sea is wide. Here we are. "
                  "On and on it goes.")
# Naming the pass key in the instruction matters to a small model: SmolLM2-135M, told only of
# "important information", answers "a magical object" when the needle is near the question.
INTRO = ("There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will ask you what the pass key is.")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key?"
ANSWER = "The pass key is"
_MARK = "PASSKEY_PROMPT_BODY"  # stands for the user's message while the chat template is split


class PasskeyError(ValueError):
    """A passkey request that cannot be met (too long for the model, too short for the needle)."""


@dataclass
class Trial:
    length: int  # prompt tokens asked for
    tokens: int  # prompt tokens built (at most `length`)
    depth: float  # where the needle sits in the filler: 0 = start, 1 = end
    needle: int  # index of the needle's first token in the prompt
    key: str
    answer: str
    found: bool


@dataclass
class PasskeyResult:
    kv: str  # the spec, canonical
    lengths: list[int]
    depths: list[float]
    accuracy: list[list[float]]  # [depth][length]: the heatmap's rows and columns
    overall: float
    trials: list[Trial]
    seconds: float

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def split_sentences(text: str) -> list[str]:
    """Whitespace collapsed, cut after . ! or ?: the needle only ever lands between sentences."""
    flat = " ".join(text.split())
    return [s for s in re.split(r"(?<=[.!?])\s+", flat) if s]


def depth_grid(depths: int) -> list[float]:
    """`depths` evenly spaced depths from 0 to 1 inclusive (a single depth is the middle)."""
    if depths < 1:
        raise PasskeyError(f"depths must be >= 1, got {depths}")
    if depths == 1:
        return [0.5]
    return [i / (depths - 1) for i in range(depths)]


def draw_keys(seed: int, n: int) -> list[str]:
    """n five-digit keys from random.Random(seed): the same seed gives the same keys."""
    rng = random.Random(seed)
    return [str(rng.randint(10000, 99999)) for _ in range(n)]


def is_found(answer: str, key: str) -> bool:
    """The key's digits in the answer; a space or comma inside the number ("68,231") is allowed."""
    return key in re.sub(r"(?<=\d)[ ,](?=\d)", "", answer)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def build_prompt(tok: Tokenizer, filler: str, length: int, depth: float, key: str,
                 chat: bool | None = None) -> tuple[list[int], tuple[int, int]]:
    """Prompt ids (at most `length` of them) with the needle at `depth`, and its span (start, end).

    The filler's sentences repeat as often as `length` needs. The text is tokenized whole, as a
    user's prompt would be; the span comes from tokenizing the text before and through the needle,
    so ids[start:end] decode to the needle (for any tokenizer that splits words at spaces).
    """
    if not 0.0 <= depth <= 1.0:
        raise PasskeyError(f"depth {depth} is outside 0..1")
    pool = split_sentences(filler)
    if not pool:
        raise PasskeyError("the filler text has no sentences")
    needle = NEEDLE.format(key=key)
    head, tail = _frame(tok, chat)
    # Sentences tokenized apart estimate their share of the whole text; the loop below corrects.
    sizes: dict[str, int] = {}
    sentences = _fill(tok, pool, length - len(tok.encode(head + needle + tail)), sizes)
    while True:
        offsets = list(accumulate((sizes[s] for s in sentences), initial=0))
        misses = [abs(o - depth * offsets[-1]) for o in offsets]
        at = misses.index(min(misses))  # the needle follows sentences[:at]
        pre = head + " ".join(sentences[:at] + [""])
        post = " ".join([""] + sentences[at:]) + tail
        ids = tok.encode(pre + needle + post)
        if len(ids) <= length:
            break
        if not sentences:
            raise PasskeyError(f"length {length} cannot hold the instruction, the needle and the "
                               f"question ({len(ids)} tokens)")
        sentences.pop()
    return ids, _span(tok, ids, pre, needle)


def _frame(tok: Tokenizer, chat: bool | None) -> tuple[str, str]:
    """The text before the filler (the instruction) and after it (the question, the answer
    begun), in the chat template when `chat` (None: where the model has one; a base model
    reads the plain text, as in the passkey test's first form)."""
    head = INTRO + "\n\n"
    tail = "\n\n" + QUESTION + " " + ANSWER
    if chat is None:
        chat = tok.chat_template is not None
    if chat:
        before, after = tok.apply_chat_template([{"role": "user", "content": _MARK}]).split(_MARK)
        head = before + head
        tail = "\n\n" + QUESTION + after + ANSWER
    return head, tail


def _fill(tok: Tokenizer, pool: list[str], room: int, sizes: dict[str, int]) -> list[str]:
    """The pool's sentences, repeated in order while their tokens (noted in `sizes`) fit `room`."""
    sentences: list[str] = []
    while True:
        s = pool[len(sentences) % len(pool)]
        if s not in sizes:
            sizes[s] = len(tok.encode(" " + s))
        if sizes[s] > room:
            return sentences
        sentences.append(s)
        room -= sizes[s]


def _span(tok: Tokenizer, ids: list[int], pre: str, needle: str) -> tuple[int, int]:
    """Where the needle's tokens sit in ids, the prompt whose text begins with pre + needle."""
    start = _common_prefix(tok.encode(pre), ids)
    end = _common_prefix(tok.encode(pre + needle), ids)
    # A whitespace token that the needle's text split off the text before is not the needle's.
    while start < end and not tok.decode(ids[start:start + 1]).strip():
        start += 1
    return start, end


def run_passkey(model: Transformer, tok: Tokenizer, spec: KVSpec | str, lengths: list[int],
                depths: int | list[float] = 5, trials: int = 1, seed: int = 0,
                text: str | None = None, scales: dict[str, torch.Tensor] | None = None,
                max_batch: int = 8, max_new_tokens: int = 10, chat: bool | None = None,
                cache_factory: Callable[..., PagedKVCache] = make_cache,
                progress: bool = False) -> PasskeyResult:
    """Every (length, depth, trial) prompt through one Engine over a cache under `spec`.

    `text` replaces the default filler; `scales` are static scales for a spec that needs them.
    `cache_factory` takes make_cache's arguments: bind attention, offload and the like with
    functools.partial. A length that leaves no room for the answer in the context is an error.
    """
    spec = KVSpec.parse(spec) if isinstance(spec, str) else spec
    grid = depth_grid(depths) if isinstance(depths, int) else [float(d) for d in depths]
    if trials < 1 or not lengths or not grid:
        raise PasskeyError("passkey needs at least one length, one depth and one trial")
    limit = model.cfg.max_seq_len
    for n in lengths:
        if n + max_new_tokens > limit:
            raise PasskeyError(f"length {n} + {max_new_tokens} answer tokens exceeds the model's "
                               f"context ({limit} tokens)")
    filler = DEFAULT_FILLER if text is None else text
    records, prompts = _trials(tok, filler, lengths, grid, trials, seed, chat)
    t0 = time.perf_counter()
    answers = _answers(model, tok, spec, prompts, scales=scales, max_batch=max_batch,
                       max_new_tokens=max_new_tokens, cache_factory=cache_factory,
                       progress=progress)
    for r, answer in zip(records, answers):
        r.answer = answer
        r.found = is_found(answer, r.key)
    accuracy = []
    for d in grid:
        hits = [[r.found for r in records if r.length == n and r.depth == d] for n in lengths]
        accuracy.append([sum(h) / len(h) for h in hits])
    overall = sum(r.found for r in records) / len(records)
    return PasskeyResult(kv=str(spec), lengths=list(lengths), depths=grid, accuracy=accuracy,
                         overall=overall, trials=records, seconds=time.perf_counter() - t0)


def _trials(tok: Tokenizer, filler: str, lengths: list[int], grid: list[float], trials: int,
            seed: int, chat: bool | None) -> tuple[list[Trial], list[list[int]]]:
    """The trials, answers pending, and their prompts: keys drawn per (length, depth, trial)."""
    keys = iter(draw_keys(seed, len(lengths) * len(grid) * trials))
    records, prompts = [], []
    for n in lengths:
        for d in grid:
            for _ in range(trials):
                key = next(keys)
                ids, (start, _) = build_prompt(tok, filler, n, d, key, chat)
                records.append(Trial(length=n, tokens=len(ids), depth=d, needle=start, key=key,
                                     answer="", found=False))
                prompts.append(ids)
    return records, prompts


def _answers(model: Transformer, tok: Tokenizer, spec: KVSpec, prompts: list[list[int]], *,
             scales: dict[str, torch.Tensor] | None, max_batch: int, max_new_tokens: int,
             cache_factory: Callable[..., PagedKVCache], progress: bool) -> list[str]:
    """The greedy answers to every prompt, through one Engine over a cache under `spec`."""
    p = next(model.parameters())
    batch = min(max_batch, len(prompts))
    longest = max(len(ids) for ids in prompts) + max_new_tokens
    bar = tqdm(total=len(prompts), desc=f"passkey {spec}", unit="prompt", disable=not progress)
    # Room for a whole batch at once: a long prompt preempted would be prefilled again.
    with cache_factory(model.cfg, spec, tokens=batch * longest, scales=scales, max_seqs=batch,
                       device=p.device, dtype=p.dtype) as cache:
        eng = Engine(model, cache, eos_ids=tok.eos_ids, max_batch=batch)
        greedy = Sampling(temperature=0, max_new_tokens=max_new_tokens)
        rids = [eng.add(ids, greedy) for ids in prompts]
        with torch.inference_mode():
            for rid, _ in eng.run():
                if eng.requests[rid].finish:
                    bar.update(1)
    bar.close()
    return [tok.decode(eng.requests[rid].new_ids, skip_special_tokens=True) for rid in rids]


def plot_heatmap(result: PasskeyResult, path: str | Path) -> None:
    """The needle-in-a-haystack heatmap as a PNG: context length across, depth down, accuracy."""
    plt = pyplot()
    n_len, n_depth = len(result.lengths), len(result.depths)
    fig, ax = plt.subplots(figsize=(2.5 + 1.1 * n_len, 1.6 + 0.45 * n_depth))
    im = ax.imshow(result.accuracy, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(n_len), [str(n) for n in result.lengths])
    ax.set_yticks(range(n_depth), [f"{d:.0%}" for d in result.depths])
    for i, row in enumerate(result.accuracy):
        for j, acc in enumerate(row):
            ax.text(j, i, f"{acc:.0%}", ha="center", va="center", fontsize=8)
    ax.set(xlabel="context length (tokens)", ylabel="needle depth (share of the filler)",
           title=f"passkey retrieval, kv {result.kv}: {result.overall:.0%}")
    fig.colorbar(im, ax=ax, label="accuracy")
    fig.tight_layout()
    save_figure(fig, path)
