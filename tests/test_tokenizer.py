"""tinykv.tokenizer against transformers' own tokenizer for the original GGUF, plus streaming
decode."""

import pytest
from tokenizers import Regex, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from tinykv.tokenizer import StreamDecoder, Tokenizer, TokenizerError

TEXTS = [
    "Hello world", "The capital of France is", "", " ", "a", "\n",
    "日本語のテキストを書きます。中文也可以。한국어도요.",
    "emoji: 🤖🚀🙂👍🏽 and 👨‍👩‍👧 family",
    "café naïve résumé Zürich coöperate Ελληνικά русский العربية",
    "tabs\tand\t\tmore\ttabs", "  two leading spaces", "trailing spaces   ",
    "line\nbreak\r\nwin\n\n\nmany",
    "1234567890", "x = 3.14159; y = -42e10; 0xFF 1,000,000 $19.99 2024-01-22 12:30",
    "I'm sure you're right, they've said it'll work, we'd agree. DON'T SHOUT",
    "def f(x):\n    return {'a': [x ** 2 for _ in range(10)]}  # comment\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "x<|endoftext|>y",
    "<repo_name>tinykv<file_sep>",
    "<|im_start |> not special <|im_end", "Ünïcödé   spaces\u00a0nbsp\u2003em-space",
    "$$$ !!! ??? ...",
]

# A run of 2+ whitespace characters right before a digit: llama.cpp's 'smollm' pre-tokenizer (and
# the model's original Digits + ByteLevel pre-tokenizer) isolates the digit first, so the whole run
# is one piece ("ĠĠ"); transformers' GGUF loader does not know 'smollm' and splits the run with the
# plain GPT-2 regex instead. These are judged against llama.cpp's definition, written out below.
WS_DIGITS = ["a  1", "x   123 456", "hello\n\n  42", "  2024", "The year 1999,   1000000",
             "a\n\n3", "\t\t7"]

CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! 🙂"},
     {"role": "user", "content": "Écris un poème.\n\nMerci"}],
]


@pytest.fixture(scope="module")
def tk(smollm2_dir):
    return Tokenizer.from_dir(smollm2_dir)


@pytest.fixture(scope="module")
def hf(smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent,
                                                      gguf_file=smollm2_gguf.name)


def test_encode_matches_transformers(tk, hf):
    for s in TEXTS:
        assert tk.encode(s) == hf(s, add_special_tokens=False)["input_ids"], repr(s)


def test_whitespace_before_digits_follows_llama_cpp(tk, hf):
    reference = HFTokenizer.from_str(hf.backend_tokenizer.to_str())
    # llama.cpp's first regex for 'smollm', then the GPT-2 regex
    digit = pre_tokenizers.Split(Regex(r"\p{N}"), "isolated")
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    reference.pre_tokenizer = pre_tokenizers.Sequence([digit, gpt2])
    for s in WS_DIGITS + TEXTS:
        assert tk.encode(s) == reference.encode(s, add_special_tokens=False).ids, repr(s)
    assert tk.encode("a  1") == [tk.tok.token_to_id(t) for t in ("a", "ĠĠ", "1")]


def test_digits_are_single_tokens(tk):
    assert tk.decode(tk.encode("1234567890")[3:4]) == "4" and len(tk.encode("1234567890")) == 10


def test_roundtrip_and_special_tokens(tk):
    for s in TEXTS + WS_DIGITS:
        assert tk.decode(tk.encode(s)) == s, repr(s)
    ids = tk.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 5  # no BOS added: add_bos_token is false
    assert tk.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert 2 in tk.eos_ids and tk.bos_id == 1


def test_chat_template_matches_transformers(tk, hf):
    for messages in CHATS:
        for gen in (True, False):
            ours = tk.apply_chat_template(messages, add_generation_prompt=gen)
            theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours == theirs


def test_golden_prompts(tk, smollm2_goldens):
    for case in smollm2_goldens["cases"]:
        if case["chat"]:
            assert tk.apply_chat_template(case["messages"]) == case["text"]
        assert tk.encode(case["text"]) == case["prompt_ids"]


def test_stream_decoder_reassembles_multibyte(tk, smollm2_goldens):
    samples = [s for s in TEXTS if s] + [tk.decode(c["new_ids"]) for c in smollm2_goldens["cases"]]
    for s in samples:
        ids, stream = tk.encode(s), StreamDecoder(tk)
        pieces = [stream.feed(i) for i in ids]
        tail = stream.flush()
        assert "".join(pieces) + tail == tk.decode(ids), repr(s)
        assert all("\ufffd" not in piece for piece in pieces) or "\ufffd" in s, repr(s)
    # An emoji spans several byte-level tokens: nothing is emitted until its last byte arrives.
    ids, stream = tk.encode("🙂"), StreamDecoder(tk)
    assert len(ids) > 1 and [stream.feed(i) for i in ids] == [""] * (len(ids) - 1) + ["🙂"]
    stream = StreamDecoder(tk)
    assert [stream.feed(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert stream.flush() == "\ufffd"


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("text", ["a \ud800 b", "caf\udce9"])
def test_text_with_a_lone_surrogate_is_a_clear_error(tk, text):
    """A JSON escape of half a surrogate pair, or a byte of another encoding that Python kept
    as a surrogate, is no text: a one-line TokenizerError, not the tokenizers library's
    TypeError."""
    with pytest.raises(TokenizerError, match="lone surrogate") as e:
        tk.encode(text)
    assert "\n" not in str(e.value)
