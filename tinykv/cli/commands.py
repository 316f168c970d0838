"""What each subcommand does with its flags: check them, call the library, print. Nothing here is
needed to use tinykv as a library."""

from __future__ import annotations

import json
import sys
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path

import torch

from ..cache import PagedKVCache, make_cache
from ..fetch import DEFAULT_DIR, fetch
from ..model import Transformer
from ..offload import OffloadConfig
from ..quant import KVSpec


class UsageError(ValueError):
    """Flags that do not fit together, found before the model loads."""


def warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)


# ---- shared --------------------------------------------------------------------------------------
def check_device_args(args) -> torch.device:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    attention = getattr(args, "attention", "auto")
    if attention == "triton" and device.type != "cuda":
        raise UsageError("--attention triton needs a CUDA device (use cpu or torch here)")
    if attention == "cpu" and device.type != "cpu":
        raise UsageError("--attention cpu runs the model on the CPU: add --device cpu")
    return device


def check_cache_args(args, specs: list[KVSpec] | None = None) -> None:
    specs = specs or [args.kv]
    if args.disk_blocks and not args.disk_dir:
        raise UsageError("--disk-blocks needs --disk-dir")
    if args.disk_dir and not args.disk_blocks:
        raise UsageError("--disk-dir needs --disk-blocks")
    if args.disk_blocks and not args.host_blocks:
        raise UsageError("the disk tier sits behind the host tier: give --host-blocks too")
    if args.disk_dir and Path(args.disk_dir).exists() and not Path(args.disk_dir).is_dir():
        raise UsageError(f"--disk-dir {args.disk_dir} is a file, not a directory")
    if args.kv_scales and not Path(args.kv_scales).is_file():
        raise UsageError(f"--kv-scales: file not found: {args.kv_scales}")
    for spec in specs:
        if spec.needs_scales and not args.kv_scales:
            raise UsageError(f"KV spec '{spec}' has static scales: pass --kv-scales FILE")
    if args.kv_scales and not any(s.needs_scales for s in specs):
        raise UsageError(f"--kv-scales given but KV spec '{specs[0]}' has no static part")


def load_model(args) -> tuple[Transformer, Path]:
    """The model the flags name (the default one is fetched on first use)."""
    device = check_device_args(args)
    torch.set_num_threads(args.threads)
    path = Path(args.weights) if args.weights else DEFAULT_DIR
    if not args.weights and not (path / "config.json").exists():
        print("[tinykv] fetching the default model (SmolLM2-135M-Instruct, ~100 MB) ...",
              file=sys.stderr, flush=True)
        fetch(path)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    return Transformer.from_pretrained(path, device=device, dtype=dtype), path


def open_cache(stack: ExitStack, model: Transformer, args, spec: KVSpec, tokens: int,
               max_seqs: int, max_step_tokens: int) -> PagedKVCache:
    """The cache the flags describe, closed (its disk file deleted) when `stack` closes."""
    scales = None
    if args.kv_scales and spec.needs_scales:
        from ..calibrate import load_scales
        scales = load_scales(args.kv_scales, model.cfg, spec)
    size = {"tokens": tokens}
    if args.device_blocks:
        size = {"blocks": args.device_blocks}
    elif args.kv_memory:
        size = {"budget_bytes": args.kv_memory}
    offload = OffloadConfig(args.host_blocks, args.disk_dir, args.disk_blocks, args.stage_blocks)
    p = next(model.parameters())
    cache = make_cache(model.cfg, spec, **size, scales=scales, attention=args.attention,
                       block_size=args.block_size, max_seqs=max_seqs,
                       max_step_tokens=max_step_tokens, offload=offload, device=p.device,
                       dtype=p.dtype)
    stack.enter_context(cache)
    return cache


def read_text(path: str | None, what: str) -> str:
    if path is None:
        raise UsageError(f"{what}: give --text FILE")
    if not Path(path).is_file():
        raise UsageError(f"{what}: text file not found: {path}")
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{what}: {path} is not UTF-8 text") from None


def check_out_path(path: str | None, flag: str) -> None:
    """Fail before the slow part when an output cannot be written."""
    if path is None:
        return
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: folder {parent} does not exist")
    if Path(path).is_dir():
        raise UsageError(f"{flag} {path} is a folder")


# ---- generate ------------------------------------------------------------------------------------
def read_prompts(args) -> list[str]:
    """The prompt words as one prompt, a whole --prompt-file as one, or a --batch file's lines."""
    given = [bool(args.prompt), bool(args.prompt_file), bool(args.batch)]
    if sum(given) != 1:
        raise UsageError("give exactly one of PROMPT, --prompt-file FILE or --batch FILE")
    if args.prompt:
        return [" ".join(args.prompt)]
    if args.prompt_file:
        text = read_text(args.prompt_file, "--prompt-file")
        if not text.strip():
            raise UsageError(f"--prompt-file {args.prompt_file} is empty")
        return [text]
    return read_batch(args.batch)


def read_batch(path: str) -> list[str]:
    """One prompt per non-empty line; a file whose lines are all JSON objects is JSONL
    ({"prompt": ...} each)."""
    lines = [ln for ln in read_text(path, "--batch").splitlines() if ln.strip()]
    if not lines:
        raise UsageError(f"--batch {path} holds no prompt")
    if not all(ln.lstrip().startswith("{") for ln in lines):
        return lines
    prompts = []
    for i, ln in enumerate(lines, 1):
        try:
            obj = json.loads(ln)
        except json.JSONDecodeError as e:
            raise UsageError(f"--batch {path}: line {i} is not JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise UsageError(f"--batch {path}: line {i} has no string \"prompt\" field")
        prompts.append(obj["prompt"])
    return prompts


def cmd_generate(args) -> None:
    from ..generate import Engine, Sampling, generation_stats
    from ..tokenizer import StreamDecoder, Tokenizer

    prompts = read_prompts(args)
    check_cache_args(args)
    model, path = load_model(args)
    tok = Tokenizer.from_dir(path)
    if args.chat:
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    ids = [tok.encode(p) for p in prompts]
    limit = model.cfg.max_seq_len
    for i, x in enumerate(ids):
        if len(x) >= limit:
            raise UsageError(f"prompt {i + 1} has {len(x)} tokens; the model's context is {limit}")
        if len(x) + args.max_new_tokens > limit:
            warn(f"prompt {i + 1} ({len(x)} tokens) leaves room for {limit - len(x)} new tokens "
                 f"in the model's context of {limit}: generation stops there")
    samp = Sampling(args.temperature, args.top_k, args.top_p, args.max_new_tokens, args.seed)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    need = sum(min(len(x) + args.max_new_tokens, limit) for x in ids) * args.n
    max_seqs = min(len(ids) * args.n, args.max_batch)
    with ExitStack() as stack:
        cache = open_cache(stack, model, args, args.kv, need, max_seqs, args.prefill_chunk)
        eng = Engine(model, cache, eos_ids=tok.eos_ids, max_batch=args.max_batch,
                     prefill_chunk=args.prefill_chunk)
        rids = [eng.add(x, samp, n=args.n) for x in ids]
        stream = len(rids) == 1 and args.n == 1 and not args.json
        dec = StreamDecoder(tok, skip_special_tokens=True)
        for _, t in eng.run():
            if stream:
                print(dec.feed(t), end="", flush=True)
        stats = generation_stats(eng)
    for w in stats.pop("warnings"):
        warn(w)
    reqs = sorted(eng.requests.values(), key=lambda r: r.rid)
    results = [{"prompt": r.rid if r.parent is None else r.parent,  # prompt i is request i
                "prompt_ids": r.tokens[:r.prompt_len], "new_ids": r.new_ids,
                "text": tok.decode(r.new_ids, skip_special_tokens=True), "finish": r.finish}
               for r in reqs]
    if args.json:
        print(json.dumps({**results[0], "stats": stats, "results": results}))
        return
    if stream:
        print(dec.flush())
    else:
        print_grouped(results, prompts, args.n)
    print(f"[tinykv] prefill {stats['prefill_tokens_per_s']:.1f} tok/s, decode "
          f"{stats['decode_tokens_per_s']:.1f} tok/s, kv {cache.spec} "
          f"{cache.bytes_per_token:.0f} B/token, {stats['blocks_used']} blocks used at peak "
          f"of {stats['blocks_total']}", file=sys.stderr)


def print_grouped(results: list[dict], prompts: list[str], n: int) -> None:
    """Each prompt once, then its samples, labelled."""
    for i, prompt in enumerate(prompts):
        short = prompt if len(prompt) <= 60 else prompt[:57] + "..."
        print(f"=== prompt {i + 1}: {short!r}")
        mine = [r for r in results if r["prompt"] == i]
        for j, r in enumerate(mine):
            label = f"--- sample {j + 1}/{n}" if n > 1 else "---"
            print(f"{label} ({r['finish']})\n{r['text']}")


# ---- fetch, calibrate, eval ----------------------------------------------------------------------
def cmd_fetch(args) -> None:
    dest = Path(args.dest) if args.dest else DEFAULT_DIR
    print(f"[tinykv] fetching SmolLM2-135M-Instruct into {dest} ...", file=sys.stderr, flush=True)
    print(fetch(dest, force=args.force))


def cmd_calibrate(args) -> None:
    from ..calibrate import calibrate_to_file, check_request
    from ..evaluate import tokens_of

    check_request(args.kv, args.observer, vllm=bool(args.vllm_out))
    for path, flag in ((args.out, "--out"), (args.vllm_out, "--vllm-out"), (args.plot, "--plot")):
        check_out_path(path, flag)
    text = read_text(args.text, "calibrate")
    model, path = load_model(args)
    tokens = tokens_of(text, path, args.offset, args.max_tokens)
    if len(tokens) < 512:
        warn(f"calibrating on {len(tokens)} tokens: static scales from so little text may clip "
             "values of other texts (use >= 512)")
    n = calibrate_to_file(model, tokens, args.kv, args.out, args.observer, args.window,
                          vllm_out=args.vllm_out, plot=args.plot)
    print(f"[tinykv] {args.out}: {args.kv} scales from {n} tokens ({args.observer})")


def cmd_eval(args) -> None:
    from .. import evaluate

    check_cache_args(args, [args.kv] + (args.plot_specs or []))
    check_out_path(args.plot, "--plot")
    if args.plot_specs and not args.plot:
        raise UsageError("--plot-specs needs --plot PNG")
    if args.task == "passkey":
        return cmd_passkey(args)
    text = read_text(args.text, "eval")
    model, path = load_model(args)
    tokens = evaluate.tokens_of(text, path, args.offset, args.max_tokens)
    specs = [args.kv] + (args.plot_specs or [])
    results = []
    for spec in specs:
        with ExitStack() as stack:
            cache = open_cache(stack, model, args, spec, args.window, 1, args.chunk)
            r = evaluate.perplexity(model, cache, tokens, args.window, args.chunk, progress=True)
        results.append(r)
        print(f"[tinykv] {r.kv}: ppl {r.ppl:.4f}, {r.kv_bytes_per_token:.0f} KV bytes/token, "
              f"{r.tokens} tokens, {r.seconds:.0f} s", file=sys.stderr)
    report = asdict(results[0])
    if args.plot:
        report["sweep"] = [asdict(r) for r in results]
        evaluate.plot_sweep(results, args.plot)
    if args.attn_error:
        scales = None
        if args.kv.needs_scales:
            from ..calibrate import load_scales
            scales = load_scales(args.kv_scales, model.cfg, args.kv)
        report["attn_error"] = evaluate.attention_error(model, tokens[:args.window], args.kv,
                                                        args.block_size, scales)
    if args.json:
        print(json.dumps(report))
        return
    for r in report.get("sweep", [report]):
        print(f"ppl {r['ppl']:.4f} over {r['tokens']} tokens, kv {r['kv']}, "
              f"{r['kv_bytes_per_token']:.0f} bytes/token")
    if "attn_error" in report:
        print("layer      kl_k      cos_k      cos_v     cos_kv   (cos_* = 1 - cosine of outputs)")
        for e in report["attn_error"]:
            print(f"{e['layer']:5d} {e['kl_k']:9.2e} {e['cos_k']:10.2e} {e['cos_v']:10.2e} "
                  f"{e['cos_kv']:10.2e}")


def cmd_passkey(args) -> None:
    raise UsageError("eval --task passkey is not wired yet")
