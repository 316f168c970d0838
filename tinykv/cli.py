"""Command line: `python -m tinykv {generate,fetch,calibrate,eval,bench}`; run.py is `generate`."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch


def is_user_error(e: BaseException) -> bool:
    """Errors that deserve one line, not a traceback: bad input, missing files, tinykv's own errors."""
    return isinstance(e, (ValueError, OSError)) or type(e).__module__.startswith("tinykv.")


def add_model_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--weights", help="model directory (config.json + *.safetensors); default: SmolLM2-135M")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")


def add_cache_args(ap: argparse.ArgumentParser, default_kv: str = "int8") -> None:
    ap.add_argument("--kv", default=default_kv, help="KV cache spec, e.g. int8, k=int4:channel:asym,v=int4:g32")
    ap.add_argument("--kv-scales", help="static scales from `tinykv calibrate`")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--device-blocks", type=int, help="KV pool size in blocks (default: what the requests need)")
    ap.add_argument("--kv-memory", help="KV pool budget in bytes, e.g. 256M or 2G (instead of --device-blocks)")
    ap.add_argument("--attention", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument("--host-blocks", type=int, default=0, help="offload tier in host memory (blocks)")
    ap.add_argument("--disk-dir", help="directory for the disk offload tier (with --disk-blocks)")
    ap.add_argument("--disk-blocks", type=int, default=0, help="disk offload tier size (blocks)")
    ap.add_argument("--stage-blocks", type=int, default=64, help="device staging buffer for offloaded blocks")


def load_model(args):
    from .fetch import DEFAULT_DIR, fetch
    from .model import Transformer

    if args.threads:
        torch.set_num_threads(args.threads)
    path = Path(args.weights) if args.weights else DEFAULT_DIR
    if not args.weights and not (path / "config.json").exists():
        fetch(path)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    return Transformer.from_pretrained(path, device=args.device, dtype=dtype), path


def parse_bytes(s: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    s = s.strip().upper().removesuffix("B").removesuffix("I")
    try:
        return int(float(s[:-1]) * units[s[-1]]) if s and s[-1] in units else int(s)
    except ValueError:
        raise ValueError(f"bad byte size '{s}' (expected e.g. 512M or 2G)") from None


def make_cache(model, args, tokens_needed: int, max_seqs: int = 16, max_step_tokens: int = 512):
    """Build the paged cache the flags describe; the pool is sized from blocks, bytes, or need."""
    from .cache import PagedKVCache
    from .quant import KVSpec

    spec = KVSpec.parse(args.kv)
    static = None
    if args.kv_scales:
        from .calibrate import load_scales
        static = load_scales(args.kv_scales, model.cfg, spec)
    dev = next(model.parameters()).device
    attention = args.attention
    if attention == "auto":
        attention = "triton" if dev.type == "cuda" else "torch"
    bs = args.block_size
    if bs < 1:
        raise ValueError("--block-size must be >= 1")
    mk = lambda n: PagedKVCache(model.cfg, spec, n, bs, max_seqs=max_seqs, max_step_tokens=max_step_tokens,
                                device=dev, dtype=next(model.parameters()).dtype, static_scales=static,
                                attention=attention, host_blocks=args.host_blocks, disk_dir=args.disk_dir,
                                disk_blocks=args.disk_blocks, stage_blocks=args.stage_blocks)
    if args.disk_blocks and not args.disk_dir:
        raise ValueError("--disk-blocks needs --disk-dir")
    if (args.disk_blocks or args.disk_dir) and not args.host_blocks:
        raise ValueError("the disk tier sits behind the host tier: give --host-blocks too")
    if args.device_blocks:
        return mk(args.device_blocks)
    if args.kv_memory:
        per_block = mk(1).bytes_per_token * bs
        return mk(max(1, int(parse_bytes(args.kv_memory) // per_block)))
    return mk(max(8, math.ceil(tokens_needed / bs) + 2 * max_seqs))


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompt_file:
        text = Path(args.prompt_file).read_text()
        # One prompt per line when several lines are given; a single (long) document otherwise
        lines = [ln for ln in text.splitlines() if ln.strip()]
        prompts += [text] if args.whole_file or len(lines) <= 1 else lines
    if not prompts:
        raise ValueError("no prompt given (pass PROMPT or --prompt-file)")
    return prompts


def cmd_generate(args) -> None:
    from .generate import Engine, Sampling
    from .tokenizer import StreamDecoder, Tokenizer

    model, path = load_model(args)
    tok = Tokenizer.from_dir(path)
    prompts = read_prompts(args)
    texts = [tok.apply_chat_template([{"role": "user", "content": p}]) if args.chat else p for p in prompts]
    ids = [tok.encode(t) for t in texts]
    samp = Sampling(args.temperature, args.top_k, args.top_p, args.max_new_tokens, args.seed)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    n_seqs = len(ids) * args.n
    need = sum(len(i) + args.max_new_tokens for i in ids) * args.n
    cache = make_cache(model, args, need, max_seqs=min(n_seqs, args.max_batch), max_step_tokens=args.prefill_chunk)
    eng = Engine(model, cache, eos_ids=tok.eos_ids, max_batch=args.max_batch, prefill_chunk=args.prefill_chunk)
    rids = [eng.add(i, samp, n=args.n) for i in ids]
    stream = len(rids) == 1 and args.n == 1 and not args.json
    dec = StreamDecoder(tok, skip_special_tokens=True)
    t0 = time.perf_counter()
    for _, t in eng.run():
        if stream:
            print(dec.feed(t), end="", flush=True)
    wall = time.perf_counter() - t0
    reqs = sorted(eng.requests.values(), key=lambda r: r.rid)
    st = eng.stats
    stats = {
        "prefill_tokens_per_s": st.prefill_tokens / st.prefill_s if st.prefill_s else 0.0,
        "decode_tokens_per_s": st.decode_tokens / st.decode_s if st.decode_s else 0.0,
        "total_tokens_per_s": sum(len(r.new_ids) for r in reqs) / wall if wall else 0.0,
        "kv_spec": str(cache.spec), "kv_bytes_per_token": cache.bytes_per_token, "kv_pool_bytes": cache.nbytes,
        "blocks_used": cache.peak_blocks, "blocks_total": cache.num_blocks, "preemptions": st.preemptions,
        "saturated_values": cache.saturated, "attention": cache.attention,
    }
    if cache.offload:
        stats["offload"] = cache.offload.stats()
        n_dec = max(1, st.decode_tokens)
        moved = sum(v for k, v in stats["offload"].items() if k.startswith("bytes_"))
        stats["offload"]["bytes_moved_per_token"] = moved / (n_dec + st.prefill_tokens)
        cache.offload.close()
    results = [{"prompt_ids": r.tokens[:r.prompt_len], "new_ids": r.new_ids, "text": tok.decode(r.new_ids),
                "finish": r.finish} for r in reqs]
    if args.json:
        print(json.dumps({**results[0], "stats": stats, "results": results}))
        return
    if stream:
        print(dec.flush() if hasattr(dec, "flush") else "")
    else:
        for r, res in zip(reqs, results):
            print(f"--- [{r.rid}] {tok.decode(r.tokens[:r.prompt_len])!r}\n{res['text']}")
    print(f"[tinykv] prefill {stats['prefill_tokens_per_s']:.1f} tok/s, decode {stats['decode_tokens_per_s']:.1f}"
          f" tok/s, kv {cache.spec} {cache.bytes_per_token:.0f} B/token, {cache.peak_blocks}/{cache.num_blocks}"
          " blocks", file=sys.stderr)


def cmd_fetch(args) -> None:
    from .fetch import DEFAULT_DIR, fetch

    print(fetch(Path(args.dest) if args.dest else DEFAULT_DIR, force=args.force))


def cmd_calibrate(args) -> None:
    from .calibrate import run_cli

    run_cli(args)


def cmd_eval(args) -> None:
    from .evaluate import run_cli

    run_cli(args)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tinykv", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text")
    g.add_argument("prompt", nargs="*")
    g.add_argument("--prompt-file", help="a file: one prompt per line (or one document, with --whole-file)")
    g.add_argument("--whole-file", action="store_true", help="treat --prompt-file as a single prompt")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-k", type=int, default=50)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--seed", type=int)
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g.add_argument("-n", type=int, default=1, help="samples per prompt (forked from one prefill)")
    g.add_argument("--max-batch", type=int, default=16, help="sequences decoded together")
    g.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens fed per step (all sequences)")
    g.add_argument("--json", action="store_true", help="print one JSON object with ids, text and stats")
    add_model_args(g)
    add_cache_args(g)
    g.set_defaults(fn=cmd_generate)
    f = sub.add_parser("fetch", help="download and convert the default model")
    f.add_argument("--dest")
    f.add_argument("--force", action="store_true")
    f.set_defaults(fn=cmd_fetch)
    c = sub.add_parser("calibrate", help="static KV scales from a text (for --kv ...:static --kv-scales)")
    c.add_argument("--kv", required=True, help="spec with static parts, e.g. int8:tensor:static")
    c.add_argument("--out", required=True, help="scale file to write (safetensors)")
    c.add_argument("--observer", default="minmax", help="minmax | percentile:P | meanstd:K")
    c.add_argument("--vllm-out", help="also write the scales in vLLM's names (+ NAME.kv_cache_scheme.json)")
    c.add_argument("--plot", help="PNG of per-channel key/value magnitudes (needs matplotlib)")
    e = sub.add_parser("eval", help="perplexity (and attention error) under a KV spec")
    e.add_argument("--chunk", type=int, default=256, help="tokens fed per step (1 = exact decode)")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.add_argument("--attn-error", action="store_true", help="per-layer attention error on the first window")
    e.add_argument("--plot-specs", nargs="+", help="more specs for the --plot chart")
    e.add_argument("--plot", help="PNG of perplexity against KV bytes/token")
    add_cache_args(e, default_kv="fp16")
    for p, max_tokens in ((c, 8192), (e, None)):
        p.add_argument("--text", required=True, help="UTF-8 text file")
        p.add_argument("--offset", type=int, default=0, help="skip this many tokens of the text")
        p.add_argument("--max-tokens", type=int, default=max_tokens, help="use at most this many tokens")
        p.add_argument("--window", type=int, default=1024, help="tokens per independent window")
        add_model_args(p)
    c.set_defaults(fn=cmd_calibrate)
    e.set_defaults(fn=cmd_eval)
    b = sub.add_parser("bench", add_help=False, help="benchmarks: `bench [--quick]` end to end, `bench kernel` "
                       "the Triton kernel, `bench profile` where a decode step's time goes")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(fn=cmd_bench)
    return ap


def cmd_bench(args) -> None:
    """`bench` runs the end-to-end benchmark (bench_e2e.py); `bench kernel` the kernel one (bench.py);
    `bench profile` splits a decode step (bench_profile.py)."""
    if args.rest[:1] == ["kernel"]:
        from .bench import main as bench_main
        bench_main(args.rest[1:])
    elif args.rest[:1] == ["profile"]:
        from .bench_profile import main as profile_main
        profile_main(args.rest[1:])
    else:
        from .bench_e2e import main as bench_main
        if bench_main(args.rest):
            raise SystemExit(1)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its own parsers (two benchmarks, their own flags)
        argv = ["bench", "--", *argv[1:]]
    args = build_parser().parse_args(argv)
    if getattr(args, "rest", None) and args.rest[0] == "--":
        args.rest = args.rest[1:]
    try:
        args.fn(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if not is_user_error(e):
            raise
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 1
    return 0
