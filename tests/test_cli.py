"""The command line as a user meets it: `python run.py` and `python -m tinykv` in a subprocess.

A table of bad inputs, each of which must end in one `error:` line on stderr and a non-zero exit
(or one `warning:` line and exit 0), never a traceback or a hang (each case has a time limit),
and leave nothing on disk. Most cases fail while parsing flags and cost a fraction of a second;
those that load a model use a tiny random Llama written here, with a word-level tokenizer.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
RUN = str(ROOT / "run.py")
# seconds per case: a hang fails the case instead of stalling the suite (generous: on a shared
# 2-core machine a case that takes 5 s alone has taken over 60)
TIMEOUT = 240
CONTEXT = 512  # the tiny model's context
NO_GPU = not torch.cuda.is_available()


# ---- a tiny model and its broken variants --------------------------------------------------------
def tiny_config() -> dict:
    return {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
            "intermediate_size": 64, "max_position_embeddings": CONTEXT, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": None,
            "eos_token_id": None}  # no end-of-sequence token: runs last as long as asked


def tiny_tensors(cfg: dict) -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face Llama names."""
    gen = torch.Generator().manual_seed(0)
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg["head_dim"]
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,),
              "lm_head.weight": (v, d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        shapes[p + "self_attn.q_proj.weight"] = (cfg["num_attention_heads"] * hd, d)
        shapes[p + "self_attn.k_proj.weight"] = (cfg["num_key_value_heads"] * hd, d)
        shapes[p + "self_attn.v_proj.weight"] = (cfg["num_key_value_heads"] * hd, d)
        shapes[p + "self_attn.o_proj.weight"] = (d, cfg["num_attention_heads"] * hd)
        shapes[p + "mlp.gate_proj.weight"] = (f, d)
        shapes[p + "mlp.up_proj.weight"] = (f, d)
        shapes[p + "mlp.down_proj.weight"] = (d, f)
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            out[name] = 1 + 0.1 * torch.randn(shape, generator=gen)
        else:
            out[name] = 0.2 * torch.randn(shape, generator=gen)
    return out


def word_tokenizer(path: Path, n_words: int = 256) -> None:
    """tokenizer.json: the words w0 .. w{n_words - 1} are the tokens 0 .. n_words - 1."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(n_words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


def write_model(d: Path, cfg: dict | list, tensors: dict[str, torch.Tensor]) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(d / "model.safetensors"))
    word_tokenizer(d / "tokenizer.json")
    return d


def words(n: int) -> str:
    return " ".join(f"w{(7 * i) % 256}" for i in range(n))


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Model folders (good and broken), texts, prompt files and scale files, by name."""
    from tinykv.calibrate import calibrate
    from tinykv.model import Transformer
    from tinykv.scalefile import save_scales
    from tinykv.spec import KVSpec

    root = tmp_path_factory.mktemp("cli_files")
    cfg, good = tiny_config(), tiny_tensors(tiny_config())
    out = {"tiny": write_model(root / "tiny", cfg, good)}
    out["list_config"] = write_model(root / "list_config", [cfg], good)
    out["zero_heads"] = write_model(root / "zero_heads", {**cfg, "num_attention_heads": 0}, good)
    out["neg_layers"] = write_model(root / "neg_layers", {**cfg, "num_hidden_layers": -1}, good)
    wrong = dict(good)
    wrong["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 31)
    out["wrong_shape"] = write_model(root / "wrong_shape", cfg, wrong)
    corrupt = write_model(root / "corrupt", cfg, good)
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file")
    out["corrupt"] = corrupt
    bad_tok = write_model(root / "bad_tokenizer", cfg, good)
    (bad_tok / "tokenizer.json").write_text("{}")
    out["bad_tokenizer"] = bad_tok
    # another model's tokenizer: more words than the embedding has rows
    foreign = write_model(root / "foreign_tokenizer", cfg, good)
    word_tokenizer(foreign / "tokenizer.json", n_words=512)
    out["foreign_tokenizer"] = foreign
    # keys of ~1e5 overflow fp16 (max 65504) to inf
    big = dict(good)
    k_proj = "model.layers.0.self_attn.k_proj.weight"
    big[k_proj] = good[k_proj] * 1e6
    out["big_keys"] = write_model(root / "big_keys", cfg, big)

    text = root / "text.txt"
    text.write_text(words(300))
    out["text"], out["short_text"] = text, root / "short.txt"
    out["short_text"].write_text(words(17))
    out["foreign_text"] = root / "foreign.txt"
    out["foreign_text"].write_text(words(300) + " w511")
    # scales that fit, then scales a million times too small: valid but absurd
    model = Transformer.from_pretrained(out["tiny"], device="cpu")
    spec = KVSpec.parse("int8:tensor:static")
    tokens = [(7 * i) % 256 for i in range(300)]
    scales = calibrate(model, tokens, spec, window=256)
    out["scales"] = root / "scales.safetensors"
    save_scales(out["scales"], scales, model.cfg, spec, "minmax", len(tokens))
    out["tiny_scales"] = root / "tiny_scales.safetensors"
    tiny = {name: s * 1e-6 for name, s in scales.items()}
    save_scales(out["tiny_scales"], tiny, model.cfg, spec, "minmax", len(tokens))

    prompts = {"empty.txt": "", "blank.txt": "\n  \n", "lines.txt": "w1 w2\nw3 w4 w5\n\nw6\n",
               "good.jsonl": '{"prompt": "w1 w2"}\n{"prompt": "w3"}\n',
               "bad_json.jsonl": '{"prompt": "w1"}\n{"prompt": "w2"\n',
               "no_field.jsonl": '{"prompt": "w1"}\n{"text": "w2"}\n',
               "empty_field.jsonl": '{"prompt": "w1"}\n{"prompt": " "}\n',
               "mixed.jsonl": '{"prompt": "w1"}\nw2 w3\n',
               "long.txt": words(CONTEXT + 10), "near_limit.txt": words(CONTEXT - 4)}
    for name, body in prompts.items():
        (root / name).write_text(body)
        out[name.replace(".", "_")] = root / name
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    out["latin1_txt"] = root / "latin1.txt"
    (root / "utf16.txt").write_text("w1 w2", encoding="utf-16")  # with its byte order mark
    out["utf16_txt"] = root / "utf16.txt"
    (root / "a_file").write_text("x")
    out["a_file"] = root / "a_file"
    out["missing"] = root / "missing"
    odd_folders(root, out, cfg, good)
    odd_files(root, out, model, spec, scales)
    return {name: str(p) for name, p in out.items()}


CHAT = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def odd_folders(root: Path, out: dict, cfg: dict, good: dict) -> None:
    """Model folders whose JSON files hold a field of the wrong type (modelfiles.Fields), and
    one with a chat template (for passkey)."""
    odd = {"bos_dict": ("tokenizer_config.json", {"bos_token": {"lstrip": False}}),
           "eos_int": ("tokenizer_config.json", {"eos_token": 2}),
           "template_list": ("tokenizer_config.json", {"chat_template": [{"name": "default"}]}),
           "template_int": ("tokenizer_config.json", {"chat_template": 7}),
           "eos_null": ("config.json", {**cfg, "eos_token_id": [None]}),
           "eps_string": ("config.json", {**cfg, "rms_norm_eps": "1e-5"}),
           "chat": ("tokenizer_config.json", {"chat_template": CHAT})}
    for name, (file, fields) in odd.items():
        d = write_model(root / name, cfg, good)
        (d / file).write_text(json.dumps(fields))
        out[name] = d


def odd_files(root: Path, out: dict, model, spec, scales: dict) -> None:
    """Files for the output-safety and input-encoding cases."""
    from tinykv.calibrate import save_scales
    from tinykv.scalefile import FORMAT, fingerprint

    big = {name: s * 1000 for name, s in scales.items()}  # valid, but nothing uses its range
    out["big_scales"] = root / "big_scales.safetensors"
    save_scales(out["big_scales"], big, model.cfg, spec, "minmax", 300)
    out["no_spec_scales"] = root / "no_spec.safetensors"
    save_file(scales, str(out["no_spec_scales"]), metadata={"format": FORMAT,
                                                            **fingerprint(model.cfg)})
    (root / "user").mkdir()
    (root / "user" / "notes.txt").write_text("my notes")
    out["user_dir"], out["a_dir"] = root / "user", root / "user"
    for name, body in (("empty_json", "{}"), ("list_json", "[1, 2]")):
        (root / f"{name}.json").write_text(body)
        out[name] = root / f"{name}.json"
    (root / "surrogate.jsonl").write_text('{"prompt": "w1 \\ud800 w2"}\n')
    (root / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"prompt": "w1 w2"}\n{"prompt": "w3"}\n')
    (root / "separators.txt").write_text("w1 w2\u2028w3\nw4\x0cw5\r\nw6\n")
    for name in ("surrogate.jsonl", "bom.jsonl", "separators.txt"):
        out[name.replace(".", "_")] = root / name
    out["long_prompt"] = root / "long_prompt.txt"
    out["long_prompt"].write_text(words(100))


# ---- running the CLI -----------------------------------------------------------------------------
def child_env(tmp: Path, **extra: str) -> dict[str, str]:
    """The CLI's environment: its temporary files go to `tmp`, so they can be looked for; Triton's
    interpreter (which conftest turns on for the tests without a GPU) only when asked for."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return {**env, "TMPDIR": str(tmp), "PYTHONPATH": str(ROOT), **extra}


def tree(path: Path) -> list[str]:
    """Every file and folder under path (what a run could leave behind)."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def prepare(tmp_path: Path) -> tuple[Path, list[str]]:
    """A work folder for one run: cwd and TMPDIR inside it; the disk tier's DIR under it is
    left for the run to create. Returns the folder and what it holds before the run."""
    work = tmp_path / "work"
    (work / "tmp").mkdir(parents=True)
    return work, tree(work)


def fill(args: list[str], files: dict[str, str], work: Path) -> list[str]:
    """The case's arguments with {name} replaced by a file path, {disk} by the disk tier's dir."""
    names = {**files, "disk": str(work / "disk" / "kv"), "out": str(work / "out.safetensors")}
    return [a.format(**names) for a in args]


def command(args: list[str]) -> list[str]:
    """`python run.py ...` for generate cases (written as run.py ...), `python -m tinykv ...`
    for the others."""
    if args[0] == "run.py":
        return [sys.executable, RUN, *args[1:]]
    return [sys.executable, "-m", "tinykv", *args]


def run_cli(args: list[str], work: Path, timeout: float = TIMEOUT,
            **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(command(args), cwd=work, env=child_env(work / "tmp", **env), text=True,
                          capture_output=True, timeout=timeout)


def noise(line: str) -> bool:
    """stderr lines that are progress, not messages: tqdm bars and tinykv's [tinykv] notes."""
    return not line.strip() or line.startswith("[tinykv]") or "it/s]" in line or "%|" in line


def check_one_line(err: str, kind: str, needle: str, clean: bool) -> None:
    """Exactly one `kind:` line (error or warning) on stderr, holding needle; no traceback; with
    clean, nothing else but progress."""
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith(f"{kind}:")]
    assert len(lines) == 1, err
    assert needle in lines[0], err
    if kind == "error":
        assert not [ln for ln in err.splitlines() if ln.startswith("warning:")], err
        assert err.splitlines()[-1] == lines[0], err  # a line of its own, last (after any bar)
    if clean:
        rest = [ln for ln in err.splitlines() if not noise(ln)]
        assert rest == lines, err


# ---- the table -----------------------------------------------------------------------------------
# (id, arguments, expected: "error" | "warning", a piece of the message)
PARSE_ERRORS = [
    ("max-batch-0", ["run.py", "w1", "--max-batch", "0"], "--max-batch"),
    ("max-batch-neg", ["run.py", "w1", "--max-batch", "-1"], "--max-batch"),
    ("device-blocks-0", ["run.py", "w1", "--device-blocks", "0"], "--device-blocks"),
    ("device-blocks-neg", ["run.py", "w1", "--device-blocks", "-1"], "--device-blocks"),
    ("kv-memory-0", ["run.py", "w1", "--kv-memory", "0"], "--kv-memory"),
    ("kv-memory-junk", ["run.py", "w1", "--kv-memory", "lots"], "--kv-memory"),
    ("kv-memory-inf", ["run.py", "w1", "--kv-memory", "1e400"], "not a finite number of bytes"),
    ("both-pool-sizes", ["run.py", "w1", "--kv-memory", "1M", "--device-blocks", "4"],
     "not allowed with"),
    ("temperature-nan", ["run.py", "w1", "--temperature", "nan"], "--temperature"),
    ("temperature-neg", ["run.py", "w1", "--temperature", "-1"], "--temperature"),
    ("top-p-neg", ["run.py", "w1", "--top-p", "-1"], "--top-p"),
    ("top-p-over-1", ["run.py", "w1", "--top-p", "1.5"], "--top-p"),
    ("top-k-neg", ["run.py", "w1", "--top-k", "-5"], "--top-k"),
    ("threads-neg", ["run.py", "w1", "--threads", "-1"], "--threads"),
    ("threads-too-many", ["run.py", "w1", "--threads", "9999"], "--threads"),
    ("host-blocks-neg", ["run.py", "w1", "--host-blocks", "-1"], "--host-blocks"),
    ("disk-blocks-neg", ["run.py", "w1", "--disk-blocks", "-1"], "--disk-blocks"),
    ("n-0", ["run.py", "w1", "-n", "0"], "-n"),
    ("n-neg", ["run.py", "w1", "-n", "-1"], "-n"),
    ("n-huge", ["run.py", "w1", "-n", "100000"], "-n"),
    ("n-over-max-batch", ["run.py", "w1", "-n", "20", "--max-batch", "8"], "--max-batch"),
    ("seed-huge", ["run.py", "w1", "--seed", str(2**70)], "--seed"),
    ("max-new-tokens-0", ["run.py", "w1", "--max-new-tokens", "0"], "--max-new-tokens"),
    ("max-new-tokens-neg", ["run.py", "w1", "--max-new-tokens", "-1"], "--max-new-tokens"),
    ("block-size-0", ["run.py", "w1", "--block-size", "0"], "--block-size"),
    ("seed-neg", ["run.py", "w1", "--seed", "-3"], "--seed"),
    ("unknown-flag", ["run.py", "w1", "--temprature", "0"], "unrecognized"),
    ("device-tpu", ["run.py", "w1", "--device", "tpu"], "--device"),
    ("eval-offset-neg", ["eval", "--text", "{text}", "--offset", "-5"], "--offset"),
    ("eval-max-tokens-0", ["eval", "--text", "{text}", "--max-tokens", "0"], "--max-tokens"),
    ("eval-window-1", ["eval", "--text", "{text}", "--window", "1"], "--window"),
    ("eval-chunk-0", ["eval", "--text", "{text}", "--chunk", "0"], "--chunk"),
    ("calibrate-no-out", ["calibrate", "--kv", "int8:tensor:static", "--text", "{text}"],
     "--out"),
    ("kv-unknown-dtype", ["run.py", "w1", "--kv", "int9"], "int9"),
    ("kv-bad-option", ["run.py", "w1", "--kv", "int8,residual=x"], "residual"),
    ("kv-with-space", ["run.py", "w1", "--kv", "int8, int4"], "--kv"),
    # a flag the run would ignore
    ("bench-flag-before-subcommand", ["bench", "--quick", "kernel"], "ignores"),
    ("bench-out-before-subcommand", ["bench", "--out", "{out}", "quality"], "ignores"),
    ("passkey-window", ["eval", "--task", "passkey", "--window", "64"], "--task passkey"),
    ("passkey-attn-error", ["eval", "--task", "passkey", "--attn-error"], "--task passkey"),
    ("passkey-chunk", ["eval", "--task", "passkey", "--chunk", "4"], "--task passkey"),
    ("ppl-lengths", ["eval", "--text", "{text}", "--lengths", "100"], "--task passkey"),
    ("stage-blocks-alone", ["run.py", "w1", "--stage-blocks", "4"], "--host-blocks"),
    ("kernel-aot-and-kv", ["bench", "kernel", "--aot", "--kv", "int4"], "--aot"),
    ("kernel-parts-without-cpu", ["bench", "kernel", "--parts", "--out", "{out}"],
     "--head-dim go with --cpu"),
    ("kernel-heads-without-cpu", ["bench", "kernel", "--heads", "2", "4", "--out", "{out}"],
     "--head-dim go with --cpu"),
    ("kernel-heads-not-a-multiple", ["bench", "kernel", "--cpu", "--heads", "3", "8", "--out",
                                     "{out}"], "a multiple of the KV heads"),
    ("kernel-head-dim-0", ["bench", "kernel", "--cpu", "--head-dim", "0"], "--head-dim"),
    ("kernel-head-dim-odd-int4", ["bench", "kernel", "--cpu", "--head-dim", "17", "--kv", "int4",
                                  "--out", "{out}"], "not a multiple of the 2 codes a byte holds"),
    ("quality-no-ppl-text", ["bench", "quality", "--no-ppl", "--text", "{text}"], "--no-ppl"),
    ("readme-and-quick", ["bench", "--readme", "{empty_json}", "--quick"], "--readme"),
    ("peers-no-speed-contexts", ["bench", "peers", "--no-speed", "--contexts", "100"],
     "--no-speed"),
    ("profile-linear-rows-0", ["bench", "profile", "--linear-rows", "0"], "--linear-rows"),
    ("profile-linear-rows-junk", ["bench", "profile", "--linear-rows", "x"], "--linear-rows"),
]

# Found before the model loads (every case names --weights, so none could fetch).
EARLY_ERRORS = [
    ("no-prompt", ["run.py", "--weights", "{tiny}"], "PROMPT"),
    ("empty-prompt", ["run.py", "", "--weights", "{tiny}"], "empty"),
    ("blank-prompt", ["run.py", "  ", "--weights", "{tiny}"], "empty"),
    ("prompt-and-batch", ["run.py", "w1", "--batch", "{lines_txt}", "--weights", "{tiny}"],
     "exactly one"),
    ("prompt-file-missing", ["run.py", "--prompt-file", "{missing}", "--weights", "{tiny}"],
     "not found"),
    ("prompt-file-empty", ["run.py", "--prompt-file", "{empty_txt}", "--weights", "{tiny}"],
     "empty"),
    ("prompt-file-latin1", ["run.py", "--prompt-file", "{latin1_txt}", "--weights", "{tiny}"],
     "UTF-8"),
    ("batch-blank", ["run.py", "--batch", "{blank_txt}", "--weights", "{tiny}"], "no prompt"),
    ("batch-bad-json", ["run.py", "--batch", "{bad_json_jsonl}", "--weights", "{tiny}"],
     "line 2"),
    ("batch-no-field", ["run.py", "--batch", "{no_field_jsonl}", "--weights", "{tiny}"],
     "line 2"),
    ("batch-empty-field", ["run.py", "--batch", "{empty_field_jsonl}", "--weights", "{tiny}"],
     "line 2"),
    ("batch-mixed", ["run.py", "--batch", "{mixed_jsonl}", "--weights", "{tiny}"], "line 2"),
    ("disk-dir-is-file", ["run.py", "w1", "--weights", "{tiny}", "--host-blocks", "4",
                          "--disk-blocks", "4", "--disk-dir", "{a_file}"], "file"),
    ("disk-dir-under-file", ["run.py", "w1", "--weights", "{tiny}", "--host-blocks", "4",
                             "--disk-blocks", "4", "--disk-dir", "{a_file}/kv"], "file"),
    ("disk-blocks-no-dir", ["run.py", "w1", "--weights", "{tiny}", "--host-blocks", "4",
                            "--disk-blocks", "4"], "--disk-dir"),
    ("static-without-scales", ["run.py", "w1", "--weights", "{tiny}", "--kv",
                               "int8:tensor:static"], "--kv-scales"),
    ("scales-missing", ["run.py", "w1", "--weights", "{tiny}", "--kv", "int8:tensor:static",
                        "--kv-scales", "{missing}"], "not found"),
    ("calibrate-out-missing-folder", ["calibrate", "--weights", "{tiny}", "--text", "{text}",
                                      "--kv", "int8:tensor:static", "--out",
                                      "{missing}/scales.safetensors"], "does not exist"),
    ("calibrate-dynamic-spec", ["calibrate", "--weights", "{tiny}", "--text", "{text}",
                                "--kv", "int8", "--out", "{out}"], "static"),
    ("eval-text-missing", ["eval", "--weights", "{tiny}", "--text", "{missing}"], "not found"),
    ("weights-missing", ["run.py", "w1", "--weights", "{missing}"], "not found"),
    ("bench-out-under-file", ["bench", "kernel", "--quick", "--out", "{a_file}/k.json"], "file"),
    ("bench-quality-nothing", ["bench", "quality", "--weights", "{tiny}", "--no-ppl",
                               "--no-passkey"], "nothing to measure"),
    ("bench-quality-filler", ["bench", "quality", "--weights", "{tiny}", "--filler",
                              "{missing}"], "not found"),
    # outputs: never an input, another output, a folder or a device; checked before the run
    ("calibrate-out-is-text", ["calibrate", "--weights", "{tiny}", "--text", "{text}", "--kv",
                               "int8:tensor:static", "--out", "{text}"], "is the input --text"),
    ("calibrate-out-is-vllm-out", ["calibrate", "--weights", "{tiny}", "--text", "{text}",
                                   "--kv", "int8:tensor:static", "--out", "{out}", "--vllm-out",
                                   "{out}"], "is also --out"),
    ("calibrate-plot-txt", ["calibrate", "--weights", "{tiny}", "--text", "{text}", "--kv",
                            "int8:tensor:static", "--out", "{out}", "--plot", "{out}.txt"],
     "not 'txt'"),
    ("calibrate-out-in-model", ["calibrate", "--weights", "{tiny}", "--text", "{text}", "--kv",
                                "int8:tensor:static", "--out", "{tiny}/config.json"],
     "--weights folder"),
    ("eval-plot-txt", ["eval", "--weights", "{tiny}", "--text", "{text}", "--plot", "{out}.txt"],
     "not 'txt'"),
    ("roofline-out-folder", ["bench", "roofline", "--quick", "--weights", "{tiny}", "--out",
                             "{a_dir}"], "is a folder"),
    ("roofline-out-is-its-chart", ["bench", "roofline", "--quick", "--weights", "{tiny}",
                                   "--out", "{out}.png"], "is also --out"),
    ("roofline-out-dev-null", ["bench", "roofline", "--quick", "--weights", "{tiny}", "--out",
                               "/dev/null"], "not a regular file"),
    ("fetch-dest-user-files", ["fetch", "--dest", "{user_dir}"], "did not write"),
    ("readme-empty-object", ["bench", "--readme", "{empty_json}"], "not a results file"),
    ("readme-list", ["bench", "--readme", "{list_json}"], "not a results file"),
    ("kernel-group-48", ["bench", "kernel", "--quick", "--kv", "int4:g48", "--out", "{out}"],
     "group size 48"),
    # text a tokenizer cannot take
    ("argv-latin1-byte", ["run.py", "w1 caf\udce9", "--weights", "{tiny}"], "byte 0xe9"),
    ("eval-text-utf16", ["eval", "--weights", "{tiny}", "--text", "{utf16_txt}"], "UTF-16"),
    ("jsonl-lone-surrogate", ["run.py", "--batch", "{surrogate_jsonl}", "--weights", "{tiny}"],
     "lone surrogate"),
]
if NO_GPU:
    EARLY_ERRORS += [
        ("device-cuda", ["run.py", "w1", "--weights", "{tiny}", "--device", "cuda"], "CUDA"),
        ("attention-triton", ["run.py", "w1", "--weights", "{tiny}", "--attention", "triton"],
         "CUDA"),
    ]

GEN = ["--max-new-tokens", "4"]
# Found once the model is loaded: the tiny one, or a broken copy of it.
MODEL_ERRORS = [
    ("kv-memory-1K", ["run.py", "w1", "--weights", "{tiny}", "--kv-memory", "1K"],
     "holds no block"),
    ("residual-huge", ["run.py", "w1", "--weights", "{tiny}", "--kv", "int8,residual=10000000000"],
     "memory"),
    ("host-blocks-huge", ["run.py", "w1", "--weights", "{tiny}", "--host-blocks", "10000000000000"],
     "memory"),
    ("disk-blocks-huge", ["run.py", "w1", "--weights", "{tiny}", "--host-blocks", "4",
                          "--disk-blocks", "100000000000000", "--disk-dir", "{disk}"], "free"),
    ("config-is-a-list", ["run.py", "w1", "--weights", "{list_config}"], "{list_config}"),
    ("negative-layers", ["run.py", "w1", "--weights", "{neg_layers}"], "n_layers"),
    ("tensor-wrong-shape", ["run.py", "w1", "--weights", "{wrong_shape}"], "{wrong_shape}"),
    ("corrupt-safetensors", ["run.py", "w1", "--weights", "{corrupt}"], "safetensors"),
    ("corrupt-tokenizer", ["run.py", "w1", "--weights", "{bad_tokenizer}"], "tokenizer.json"),
    ("foreign-tokenizer", ["run.py", "w1 w300", "--weights", "{foreign_tokenizer}"],
     "token id 300, past the model's 256 tokens"),
    ("eval-foreign-tokenizer", ["eval", "--weights", "{foreign_tokenizer}", "--text",
                                "{foreign_text}"], "tokenizer.json is not this model's"),
    ("prompt-over-context", ["run.py", "--prompt-file", "{long_txt}", "--weights", "{tiny}"],
     "context"),
    ("fp16-overflow", ["run.py", "w1 w2 w3", "--weights", "{big_keys}", "--kv", "fp16", *GEN],
     "NaN"),
    ("eval-fp16-overflow", ["eval", "--weights", "{big_keys}", "--kv", "fp16", "--text",
                            "{text}", "--window", "64"], "finite"),
    ("eval-window-over-context", ["eval", "--weights", "{tiny}", "--text", "{text}",
                                  "--window", "1000"], "context"),
    ("peers-packed-float-weights", ["bench", "peers", "--weights", "{tiny}", "--packed-weights",
                                    "--out", "{out}"], "bench peers needs every one packed"),
    ("bench-quality-length", ["bench", "quality", "--weights", "{tiny}", "--no-ppl",
                              "--lengths", "100000", "--out", "{out}"], "context"),
    # model folders with a field of the wrong type: the file and the field, in one line
    ("bos-token-dict", ["run.py", "w1", "--weights", "{bos_dict}"], "'bos_token'"),
    ("eos-token-int", ["run.py", "w1", "--weights", "{eos_int}"], "'eos_token'"),
    ("template-list", ["run.py", "w1", "--weights", "{template_list}", "--chat"],
     "'chat_template'"),
    ("template-int", ["run.py", "w1", "--weights", "{template_int}"], "'chat_template'"),
    ("eos-id-null", ["run.py", "w1", "--weights", "{eos_null}"], "'eos_token_id'"),
    ("eps-string", ["run.py", "w1", "--weights", "{eps_string}"], "'rms_norm_eps'"),
    ("scales-no-spec", ["run.py", "w1", "--weights", "{tiny}", "--kv", "int8:tensor:static",
                        "--kv-scales", "{no_spec_scales}"], "no valid KV spec"),
    # what does not fit is refused before the run, the same rule for every command
    ("eval-window-over-pool", ["eval", "--weights", "{tiny}", "--text", "{text}",
                               "--device-blocks", "1", "--window", "64"], "--window 64"),
    ("passkey-kv-memory-1K", ["eval", "--task", "passkey", "--weights", "{chat}", "--lengths",
                              "64", "--depths", "1", "--kv-memory", "1K"], "holds no block"),
    ("prompt-over-pool", ["run.py", "--prompt-file", "{long_prompt}", "--weights", "{tiny}",
                          "--device-blocks", "1", *GEN], "prompt 1 needs 6 blocks"),
    ("evict-budget-over-device", ["run.py", "--prompt-file", "{long_prompt}", "--weights",
                                  "{tiny}", "--kv", "int8,evict=h2o:100", "--device-blocks", "2",
                                  "--host-blocks", "16", *GEN], "evict=h2o:100"),
]
# The model's zero heads: torch warns about zero-element tensors on stderr before the error,
# until model.Config refuses the config itself.
UNCLEAN = {"zero-heads"}
MODEL_ERRORS.append(("zero-heads", ["run.py", "w1", "--weights", "{zero_heads}"], "zero_heads"))

WARNINGS = [
    ("prompt-near-context", ["run.py", "--prompt-file", "{near_limit_txt}", "--weights", "{tiny}",
                             "--max-new-tokens", "8"], "room for 4 new tokens"),
    ("absurd-scales", ["run.py", "w1 w2 w3 w4", "--weights", "{tiny}", "--kv",
                       "int8:tensor:static", "--kv-scales", "{tiny_scales}", *GEN], "clipped"),
    ("eval-absurd-scales", ["eval", "--weights", "{tiny}", "--kv", "int8:tensor:static",
                            "--kv-scales", "{tiny_scales}", "--text", "{text}", "--window", "64"],
     "clipped"),
    ("calibrate-17-tokens", ["calibrate", "--weights", "{tiny}", "--text", "{short_text}",
                             "--kv", "int8:tensor:static", "--out", "{out}"], "17 tokens"),
    ("scales-1000x-too-large", ["run.py", "w1 w2 w3 w4", "--weights", "{tiny}", "--kv",
                                "k=int8:tensor:static,v=fp32", "--kv-scales", "{big_scales}",
                                *GEN], "far too large"),
    ("eval-scales-1000x-too-large", ["eval", "--weights", "{tiny}", "--kv",
                                     "k=fp32,v=int8:tensor:static", "--kv-scales",
                                     "{big_scales}", "--text", "{text}", "--window", "64"],
     "far too large"),
]

TABLE = ([(c, a, "error", n) for c, a, n in PARSE_ERRORS + EARLY_ERRORS + MODEL_ERRORS]
         + [(c, a, "warning", n) for c, a, n in WARNINGS])


WORKERS = max(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2)


def run_case(args: list[str], work: Path) -> subprocess.CompletedProcess | Exception:
    """One case's run, or its timeout (reported by the case's own test)."""
    try:
        return run_cli(args, work)
    except subprocess.TimeoutExpired as e:
        return e


@pytest.fixture(scope="module")
def table_runs(files: dict[str, str], tmp_path_factory: pytest.TempPathFactory,
               request: pytest.FixtureRequest) -> dict[str, tuple]:
    """The selected cases of TABLE, run side by side (a few per core: most of their time is
    Python importing torch): case -> (work folder, its contents before, the run)."""
    wanted = set()
    for item in request.session.items:
        if getattr(item, "originalname", None) == "test_bad_input":
            wanted.add(item.callspec.params["case"])
    root = tmp_path_factory.mktemp("cases")
    futures = {}
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        for case, args, _, _ in TABLE:
            if case not in wanted:
                continue
            work, before = prepare(root / case)
            futures[case] = (work, before, pool.submit(run_case, fill(args, files, work), work))
    return {case: (work, before, f.result()) for case, (work, before, f) in futures.items()}


@pytest.mark.parametrize("case, args, kind, needle", TABLE, ids=[row[0] for row in TABLE])
def test_bad_input(case: str, args: list[str], kind: str, needle: str, files: dict[str, str],
                   table_runs: dict[str, tuple]) -> None:
    work, before, r = table_runs[case]
    if isinstance(r, subprocess.TimeoutExpired):
        pytest.fail(f"no answer within {TIMEOUT} s (a hang?): {' '.join(map(str, r.cmd))}")
    check_one_line(r.stderr, kind, needle.format(**files), clean=case not in UNCLEAN)
    if kind == "error":
        assert r.returncode != 0, r.stderr
    else:
        assert r.returncode == 0, r.stderr
    left = [p for p in tree(work) if p not in before and p != "out.safetensors"]
    assert left == [], left


def test_flag_errors_come_before_torch(tmp_path: Path) -> None:
    """A typo in a flag answers at once: parsing imports no torch."""
    work, _ = prepare(tmp_path)
    code = ("import sys\nfrom tinykv.cli import main\n"
            "try:\n    main(['generate', 'w', '--top-k', '-1'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], cwd=work, env=child_env(work / "tmp"),
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.stderr.startswith("error:") and r.stdout.strip() == "False", r.stderr


def test_idle_openmp_threads_spin_a_while_unless_told(tmp_path: Path) -> None:
    """The CLI lets idle OpenMP threads spin GOMP_SPINCOUNT=10000 times before they sleep (a
    thread woken from sleep costs each parallel kernel ~90 us on a VM); a value the environment
    gives stays, and the CLI does not make threads sleep at once (OMP_WAIT_POLICY=passive)."""
    work, _ = prepare(tmp_path)
    code = ("import os\nimport tinykv.cli\n"
            "print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))")
    env = {k: v for k, v in child_env(work / "tmp").items()
           if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    for given, want in ((None, "10000 None"), ("250", "250 None")):
        extra = {} if given is None else {"GOMP_SPINCOUNT": given}
        r = subprocess.run([sys.executable, "-c", code], cwd=work, env={**env, **extra},
                           capture_output=True, text=True, timeout=TIMEOUT)
        assert r.returncode == 0 and r.stdout.strip() == want, (r.stdout, r.stderr)


# ---- what works ----------------------------------------------------------------------------------
def generate_json(args: list[str], files: dict[str, str], work: Path) -> dict:
    r = run_cli(fill(["run.py", *args, "--weights", "{tiny}", "--json", *GEN], files, work), work)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    return json.loads(r.stdout)


def test_prompt_words_are_one_prompt(files: dict[str, str], tmp_path: Path) -> None:
    """The words are one prompt; a one-block pool is legal."""
    work, _ = prepare(tmp_path)
    out = generate_json(["w1", "w2", "w3", "--device-blocks", "1"], files, work)
    assert len(out["results"]) == 1 and out["prompt_ids"] == [1, 2, 3]
    assert len(out["new_ids"]) == 4 and out["stats"]["blocks_total"] == 1


def test_packed_weights_say_how_many_were_packed(files: dict[str, str], tmp_path: Path) -> None:
    """--packed-weights on a model of trained (random) float32 weights: none packs, the run says
    so and decodes the same tokens as without the flag."""
    work, _ = prepare(tmp_path)
    args = ["run.py", "w1", "w2", "--weights", "{tiny}", "--json", "--device", "cpu",
            "--temperature", "0", *GEN]
    plain = run_cli(fill(args, files, work), work)
    packed = run_cli(fill([*args, "--packed-weights"], files, work), work)
    assert packed.returncode == 0 and "Traceback" not in packed.stderr, packed.stderr
    assert "[tinykv] packed weights: 0 of" in packed.stderr
    assert json.loads(packed.stdout)["new_ids"] == json.loads(plain.stdout)["new_ids"]


def test_an_answer_of_one_token_shows_no_decode_rate(files: dict[str, str],
                                                    tmp_path: Path) -> None:
    """One new token comes from the prefill, with no decode step: the line says so instead of
    'decode 0.0 tok/s'; two tokens give a rate."""
    work, _ = prepare(tmp_path)
    args = ["run.py", "w1", "--weights", "{tiny}", "--temperature", "0", "--max-new-tokens"]
    one = run_cli(fill([*args, "1"], files, work), work)
    assert one.returncode == 0 and "decode - (no decode step" in one.stderr, one.stderr
    two = run_cli(fill([*args, "2"], files, work), work)
    assert two.returncode == 0 and re.search(r"decode \d+\.\d tok/s", two.stderr), two.stderr


@pytest.mark.parametrize("kv, n_words", [("int8", 12), ("k=int4:channel:asym,v=int4:g8:asym", 12),
                                         ("k=int4:channel,v=int4:g8,sink=2,residual=16", 40)])
def test_timed_steps_compile_nothing(kv: str, n_words: int, files: dict[str, str],
                                     tmp_path: Path) -> None:
    """The prefill and decode rates time the run's own steps: its kernels were compiled or
    loaded (numba's overloads) by a warm-up before them, so no overload appears during them,
    blocks quantized past the full-precision tokens included."""
    work, _ = prepare(tmp_path)
    args = fill(["generate", words(n_words), "--weights", "{tiny}", "--temperature", "0",
                 "--max-new-tokens", "6", "--kv", kv], files, work)
    script = f"""
import gc, sys
from numba.core.registry import CPUDispatcher
from tinykv.cli import commands, main
def overloads():
    return sum(len(d.overloads) for d in gc.get_objects() if isinstance(d, CPUDispatcher))
real, seen = commands.run_engine, []
def timed(eng, dec):
    seen.append(overloads())
    stats = real(eng, dec)
    seen.append(overloads())
    return stats
commands.run_engine = timed
status = main({args!r})
print("overloads", *seen, file=sys.stderr)
sys.exit(status)
"""
    r = subprocess.run([sys.executable, "-c", script], cwd=work, env=child_env(work / "tmp"),
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr
    before, after = map(int, r.stderr.split("overloads")[1].split())
    assert before > 0 and after == before, r.stderr


def test_passkey_on_a_base_model(files: dict[str, str], tmp_path: Path) -> None:
    """eval --task passkey on a model with no chat template (the tiny one): the plain prompt,
    a table and a count, not 'run without --chat' (a flag eval does not have)."""
    work, _ = prepare(tmp_path)
    r = run_cli(fill(["eval", "--task", "passkey", "--weights", "{tiny}", "--lengths", "96",
                      "--depths", "1"], files, work), work)
    assert r.returncode == 0, r.stderr
    assert "found" in r.stderr and "depth" in r.stdout


def test_prompt_file_is_one_prompt(files: dict[str, str], tmp_path: Path) -> None:
    work, _ = prepare(tmp_path)
    out = generate_json(["--prompt-file", "{lines_txt}"], files, work)
    assert [r["prompt_ids"] for r in out["results"]] == [[1, 2, 3, 4, 5, 6]]


def test_batch_lines(files: dict[str, str], tmp_path: Path) -> None:
    work, _ = prepare(tmp_path)
    out = generate_json(["--batch", "{lines_txt}"], files, work)
    assert [r["prompt_ids"] for r in out["results"]] == [[1, 2], [3, 4, 5], [6]]


def test_batch_jsonl_samples_are_grouped_and_labelled(files: dict[str, str],
                                                      tmp_path: Path) -> None:
    work, _ = prepare(tmp_path)
    args = ["run.py", "--batch", "{good_jsonl}", "-n", "2", "--weights", "{tiny}", *GEN]
    r = run_cli(fill(args, files, work), work)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    heads = [ln for ln in lines if ln.startswith("===") or ln.startswith("---")]
    assert heads == ["=== prompt 1/2: 'w1 w2'", "--- sample 1/2 (length)",
                     "--- sample 2/2 (length)", "=== prompt 2/2: 'w3'",
                     "--- sample 1/2 (length)", "--- sample 2/2 (length)"], r.stdout


def test_disk_tier_leaves_nothing(files: dict[str, str], tmp_path: Path) -> None:
    """A run with a disk tier (sized by --kv-memory, with a huge staging buffer asked for)
    deletes its file and the folders it made; a folder that was there stays."""
    work, _ = prepare(tmp_path)
    (work / "disk").mkdir()
    before = tree(work)
    offload = ["--host-blocks", "2", "--disk-blocks", "8", "--disk-dir", "{disk}",
               "--stage-blocks", "100000000000"]  # staging: no more than the tiers hold
    out = generate_json(["w1 w2", "--kv-memory", "1K", "--block-size", "1", *offload], files, work)
    assert out["stats"]["offload"]
    assert tree(work) == before


def test_refused_outputs_leave_the_users_files(files: dict[str, str], tmp_path: Path) -> None:
    """calibrate --out TEXT and fetch --dest FOLDER-OF-MINE are refused before anything is
    written: the text and the folder's files are as they were."""
    work, _ = prepare(tmp_path)
    text = work / "mine.txt"
    text.write_text(words(300))
    r = run_cli(["calibrate", "--weights", files["tiny"], "--text", str(text), "--kv",
                 "int8:tensor:static", "--out", str(text)], work)
    assert r.returncode == 1 and text.read_text() == words(300), r.stderr
    mine = work / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    r = run_cli(["fetch", "--dest", str(mine)], work)
    assert r.returncode == 1 and tree(mine) == ["notes.txt"], r.stderr
    assert (mine / "notes.txt").read_text() == "my notes"


def test_calibrate_writes_every_output_whole(files: dict[str, str], tmp_path: Path) -> None:
    """Scales, the vLLM export (and the scheme beside it) and the chart, replacing an old file
    in place, with no temporary file left."""
    pytest.importorskip("matplotlib")
    work, _ = prepare(tmp_path)
    (work / "s.safetensors").write_text("an old scale file")
    r = run_cli(fill(["calibrate", "--weights", "{tiny}", "--text", "{text}", "--kv",
                      "int8:tensor:static", "--out", "s.safetensors", "--vllm-out",
                      "v.safetensors", "--plot", "c.png"], files, work), work)
    assert r.returncode == 0, r.stderr
    assert tree(work) == ["c.png", "s.safetensors", "tmp", "v.kv_cache_scheme.json",
                          "v.safetensors"]
    assert (work / "s.safetensors").read_bytes()[:8] != b"an old s"


def test_tiny_temperature_samples(files: dict[str, str], tmp_path: Path) -> None:
    work, _ = prepare(tmp_path)
    out = generate_json(["w1 w2", "--temperature", "1e-300"], files, work)
    assert len(out["new_ids"]) == 4


def test_snapkv_with_offload(files: dict[str, str], tmp_path: Path) -> None:
    """The README's offload example with eviction: a prompt longer than the device pool, whose
    blocks snapkv reads where they were offloaded."""
    work, _ = prepare(tmp_path)
    out = generate_json(["--prompt-file", "{long_prompt}", "--kv", "int8,sink=4,evict=snapkv:20",
                         "--device-blocks", "2", "--host-blocks", "16"], files, work)
    assert out["stats"]["offload"]["blocks_device_to_host"] > 0 and len(out["new_ids"]) == 4


def test_pool_is_sized_for_what_runs_at_once(files: dict[str, str], tmp_path: Path) -> None:
    """64 prompts, 2 at a time: the pool holds 2 sequences (make_cache's minimum of 8 blocks),
    not all 64, so a batch of 200,000 prompts is not refused for its total."""
    work, _ = prepare(tmp_path)
    (work / "many.txt").write_text("w1 w2\n" * 64)
    out = generate_json(["--batch", str(work / "many.txt"), "--max-batch", "2"], files, work)
    assert len(out["results"]) == 64 and out["stats"]["blocks_total"] == 8


def test_batch_shows_progress(files: dict[str, str], tmp_path: Path) -> None:
    work, _ = prepare(tmp_path)
    r = run_cli(fill(["run.py", "--batch", "{lines_txt}", "--weights", "{tiny}", *GEN], files,
                     work), work)
    assert r.returncode == 0 and "generate: 100%" in r.stderr and "3/3" in r.stderr, r.stderr


def test_batch_files_split_on_newlines_only(files: dict[str, str], tmp_path: Path) -> None:
    """A byte order mark is no part of the first line; U+2028 and a form feed are inside a line;
    a CRLF line ends at its \\n."""
    work, _ = prepare(tmp_path)
    out = generate_json(["--batch", "{bom_jsonl}"], files, work)
    assert [r["prompt_ids"] for r in out["results"]] == [[1, 2], [3]]
    out = generate_json(["--batch", "{separators_txt}"], files, work)
    assert [r["prompt_ids"] for r in out["results"]] == [[1, 2, 3], [4, 5], [6]]


def test_text_line_endings_are_not_content(tmp_path: Path) -> None:
    """A text saved with CRLF (as WikiText-2's raw file is) or CR reads as the LF text, so it
    tokenizes and measures the same; a BOM goes, U+2028 and a form feed stay."""
    from tinykv.cli.inputs import read_text

    body = "first line\u2028same line\x0c\nsecond\n\nthird"
    (tmp_path / "lf.txt").write_bytes(body.encode())
    (tmp_path / "crlf.txt").write_bytes(b"\xef\xbb\xbf" + body.replace("\n", "\r\n").encode())
    (tmp_path / "cr.txt").write_bytes(body.replace("\n", "\r").encode())
    texts = [read_text(str(tmp_path / f"{name}.txt"), "--text") for name in ("lf", "crlf", "cr")]
    assert texts == [body, body, body]


@pytest.mark.parametrize("name", ["-", "/dev/stdin"])
def test_prompt_from_stdin(files: dict[str, str], tmp_path: Path, name: str) -> None:
    work, _ = prepare(tmp_path)
    args = ["run.py", "--prompt-file", name, "--weights", files["tiny"], "--json", *GEN]
    r = subprocess.run(command(args), cwd=work, env=child_env(work / "tmp"), text=True,
                       capture_output=True, timeout=TIMEOUT, input="w1 w2 w3\n")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["prompt_ids"] == [1, 2, 3]


@pytest.mark.parametrize("block_size", ["64", "4096"])
def test_bench_kernel_block_larger_than_a_context(tmp_path: Path, block_size: str) -> None:
    """Blocks of 64 or 4096 tokens over the quick grid's contexts of 32 and 80: each sequence
    takes whole blocks (the pool was sized by tokens / block size, too few)."""
    work, _ = prepare(tmp_path)
    r = run_cli(["bench", "kernel", "--quick", "--kv", "int8", "--block-size", block_size,
                 "--out", "k.json"], work)
    assert r.returncode == 0, r.stderr
    assert {row["context"] for row in json.loads((work / "k.json").read_text())["rows"]} == \
        {32, 80}


def test_bench_cpu_kernel_prints_its_ceilings_and_fixed_costs(tmp_path: Path) -> None:
    """bench kernel --cpu --quick --parts: each row beside its touch ceiling, the fixed costs per
    call in a loop and right after a layer's worth of reads (cold), and where a call's time goes,
    in the JSON and printed."""
    work, _ = prepare(tmp_path)
    r = run_cli(["bench", "kernel", "--cpu", "--quick", "--kv", "int8", "--parts", "--out",
                 "k.json"], work)
    assert r.returncode == 0, r.stderr
    parts = json.loads((work / "k.json").read_text())["parts"]
    assert [(row["kv"], row["batch"], row["context"]) for row in parts] == \
        [("int8", 1, 256), ("int8", 2, 128)]
    assert all(row["whole_ms"] > 0 and row["rest_ms"] > 0 and row["l1_ms"] > 0 for row in parts)
    assert "Where a call's time goes" in r.stdout and "whole, K/V in L1" in r.stdout
    results = json.loads((work / "k.json").read_text())
    assert {(row["batch"], row["context"]) for row in results["rows"]} == {(1, 256), (2, 128)}
    assert all(row["touch_ms"] > 0 and row["ms"] > 0 for row in results["rows"])
    # the ceiling is the faster of the touch's two reads, both kept
    assert all(row["touch_ms"] == min(row["touch_plain_ms"], row["touch_ahead_ms"])
               for row in results["rows"])
    assert "Touch: the faster of plain loads" in r.stdout
    fixed = results["fixed_us"]["int8"]
    assert all(fixed[k] > 0 for k in ("attend_us", "dispatch_us", "store_us", "attend_cold_us",
                                      "store_cold_us", "direct_attend_us", "direct_store_us",
                                      "direct_attend_cold_us", "direct_store_cold_us"))
    assert "cold: attend" in r.stdout and "direct: attend" in r.stdout
    assert len(results["machine"]["overlap"]["rates"]) == 3 and "Reads beside work" in r.stdout


def test_bench_cpu_kernel_at_another_model_shape(tmp_path: Path) -> None:
    """bench kernel --cpu --heads KV Q --head-dim D: pools of that shape, in the JSON and said
    above the table; 8 query heads of 128 channels a KV head go in two passes of 4."""
    work, _ = prepare(tmp_path)
    r = run_cli(["bench", "kernel", "--cpu", "--quick", "--kv", "int8", "--heads", "2", "16",
                 "--head-dim", "128", "--out", "k.json"], work)
    assert r.returncode == 0, r.stderr
    results = json.loads((work / "k.json").read_text())
    assert {k: results["shape"][k] for k in ("kv_heads", "n_rep", "head_dim")} == \
        {"kv_heads": 2, "n_rep": 8, "head_dim": 128}
    assert all(row["ms"] > 0 and row["touch_ms"] > 0 for row in results["rows"])
    assert "Pools of 2 KV heads, 8 query heads each, head_dim 128" in r.stdout
    assert "blocks 2 times, 4 of its query heads a pass" in r.stdout


def test_a_chart_beside_out_that_tinykv_did_not_write_is_left_alone(tmp_path: Path) -> None:
    """bench kernel --cpu --out k.json writes its chart as k.png: a k.png of the user's is
    refused in one line before any run, and stays as it was."""
    work, _ = prepare(tmp_path)
    (work / "k.png").write_bytes(b"the user's picture")
    r = run_cli(["bench", "kernel", "--cpu", "--quick", "--out", "k.json"], work)
    assert r.returncode == 1 and "is not one tinykv wrote" in r.stderr, r.stderr
    assert (work / "k.png").read_bytes() == b"the user's picture"
    assert not (work / "k.json").exists()


def test_bench_kernel_cpu_runs_the_default_specs_that_fit_a_head_dim(tmp_path: Path) -> None:
    """--head-dim 48 without --kv: KIVI-style (value groups of 32) is left out and named on
    stderr, the other default specs run."""
    work, _ = prepare(tmp_path)
    r = run_cli(["bench", "kernel", "--cpu", "--quick", "--head-dim", "48", "--out", "k.json"],
                work)
    assert r.returncode == 0, r.stderr
    ran = {row["kv"] for row in json.loads((work / "k.json").read_text())["rows"]}
    assert ran == {"fp16", "int8", "int4"}
    assert "k=int4:channel:asym,v=int4:g32:asym is left out" in r.stderr
    assert "head_dim 48 is not a multiple of the group size 32" in r.stderr


@pytest.mark.skipif(not NO_GPU, reason="with a GPU, --attention triton runs compiled")
def test_triton_interpreter_on_the_cpu(files: dict[str, str], tmp_path: Path) -> None:
    """TRITON_INTERPRET=1: the Triton kernels decode on the CPU, through Triton's interpreter."""
    pytest.importorskip("triton")
    work, _ = prepare(tmp_path)
    r = run_cli(fill(["run.py", "w1 w2", "--weights", "{tiny}", "--attention", "triton",
                      "--json", *GEN], files, work), work, TRITON_INTERPRET="1")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["stats"]["attention"] == "triton"


def test_help_describes_and_shows_defaults(tmp_path: Path) -> None:
    work, _ = prepare(tmp_path)
    r = run_cli(["run.py", "--help"], work)
    assert r.returncode == 0
    assert r.stdout.startswith("usage: run.py")
    assert "The words of PROMPT are one prompt" in r.stdout
    assert "(default: 128)" in r.stdout and "(default: int8)" in r.stdout
    assert "half of this machine's" in r.stdout
    r = run_cli(["fetch", "--help"], work)
    assert "PyPI" in r.stdout and "--force" in r.stdout and "download and convert" in r.stdout
    for cmd in ("calibrate", "eval", "bench"):
        r = run_cli([cmd, "--help"], work)
        assert r.returncode == 0 and "(default:" in r.stdout, cmd


# ---- Ctrl-C --------------------------------------------------------------------------------------
def default_sigint() -> None:
    """Let the child take Ctrl-C even when the test runs in a shell that ignores it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for_file(folder: Path, p: subprocess.Popen) -> None:
    """Until a file appears under folder (the disk tier is open), while the process runs."""
    t0 = time.perf_counter()
    while not [f for f in folder.rglob("*") if f.is_file()]:
        assert p.poll() is None, "the run ended before its disk tier was seen"
        assert time.perf_counter() - t0 < TIMEOUT, "no disk tier file"
        time.sleep(0.05)


@pytest.mark.parametrize("raised, status, word", [("KeyboardInterrupt", 130, "interrupted"),
                                                   ("cli.Terminated", 143, "terminated")])
def test_interrupt_stays_one_line_when_a_finalizer_fails_at_exit(raised: str, status: int,
                                                                 word: str) -> None:
    """A signal that lands while numba compiles can leave an llvmlite object half built, whose
    finalizer then fails as the process ends: still one `error:` line and no traceback. The
    command here leaves such an object (in a cycle, so only the exit collects it) and raises."""
    script = f"""
import sys
from tinykv import cli

class HalfBuilt:
    def __del__(self):
        del self.handle  # never set: AttributeError in a finalizer

def interrupted(args):
    leftover = HalfBuilt()
    leftover.cycle = leftover
    raise {raised}

cli.load_command = lambda name: interrupted
sys.exit(cli.main(["fetch"]))
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert r.returncode == status, r.stderr
    assert r.stderr == f"error: {word}\n"


@pytest.mark.parametrize("sig, when", [(signal.SIGINT, "importing"),
                                       (signal.SIGINT, "generating"),
                                       (signal.SIGTERM, "generating")],
                         ids=["ctrl-c-importing", "ctrl-c-generating", "sigterm-generating"])
def test_interrupted_run_is_one_line_and_leaves_nothing(sig: int, when: str,
                                                        files: dict[str, str],
                                                        tmp_path: Path) -> None:
    """Interrupted while importing torch (1 s in) or while generating with a disk tier open:
    `error: interrupted` (or `terminated`), exit 130 (143), and the disk tier's file and folders
    are gone."""
    work, before = prepare(tmp_path)
    args = fill(["run.py", "w1 w2", "--weights", "{tiny}", "--max-new-tokens", "500",
                 "--device-blocks", "4", "--host-blocks", "4", "--disk-blocks", "40",
                 "--disk-dir", "{disk}"], files, work)
    p = subprocess.Popen(command(args), cwd=work, env=child_env(work / "tmp"), text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=default_sigint)
    try:
        if when == "importing":
            time.sleep(1.0)
        else:
            wait_for_file(work / "disk", p)
        p.send_signal(sig)
        _, err = p.communicate(timeout=TIMEOUT)
    finally:
        p.kill()
    if sig == signal.SIGINT:
        assert p.returncode == 130, err
        check_one_line(err, "error", "interrupted", clean=True)
    else:
        assert p.returncode == 143, err
        check_one_line(err, "error", "terminated", clean=True)
    assert tree(work) == before
