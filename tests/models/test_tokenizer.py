"""jpaged's GGUF and HF-dir tokenizers agree with transformers' tokenizer of the embedded model."""

from __future__ import annotations

import json

import pytest

from models import Tokenizer

TEXTS = [
    "Hello world",
    "What is the capital of France?",
    "  leading and trailing spaces   ",
    " single leading space",
    "numbers 2024, 3.14159 and 1234567890",
    "北京是中国的首都。我爱自然语言处理！",
    "日本語とEnglishのmixed テキスト",
    "def f(x):\n\tif x:\n\t\treturn x ** 2  # tab-indented\n\n\n    spaces\r\n",
    "emoji 😀🎉👍🏽 and flags 🇫🇷 and zwj 👨‍👩‍👧",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<|im_end|>",
    "<|im_start|> spaced special <|im_end|>",
    "don't won't it's I'm we'll they've you'd",
    "",
    " ",
    "\n\n",
    "Ünïcödé àccents — “quotes” … ©®™",
    "<repo_name>jpaged<file_sep>models/llama.py",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi!"}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? 中文 😀"},
    ],
]


@pytest.fixture(scope="module")
def ours(embedded):
    return embedded.tokenizer  # Tokenizer.from_gguf_metadata of the GGUF's metadata


@pytest.fixture(scope="module")
def theirs(embedded_path):
    pytest.importorskip("torch")  # transformers' GGUF reader needs it
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        str(embedded_path.parent), gguf_file=embedded_path.name
    )


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(ours, theirs, text):
    for special in (True, False):
        ids = ours.encode(text, add_special_tokens=special)
        assert ids == theirs.encode(text, add_special_tokens=special)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip
            )
    assert ours.decode(ours.encode(text), skip_special_tokens=False) == text  # byte-level: lossless


def test_special_tokens_match_transformers(ours, theirs):
    assert ours.bos_token_id == theirs.bos_token_id
    assert ours.eos_token_id == theirs.eos_token_id == 2
    assert ours.vocab_size == len(theirs) == 49152
    assert set(theirs.all_special_ids) <= set(ours.all_special_ids)
    ids = theirs.encode("<|im_start|>Hello world")
    assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, theirs, messages, add_generation_prompt):
    assert ours.has_chat_template
    got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    want = theirs.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert got == want
    assert ours.encode(got) == theirs.encode(want)


def test_hf_dir_tokenizer_matches_transformers(theirs, tmp_path):
    theirs.save_pretrained(tmp_path)
    from_dir = Tokenizer.from_hf_dir(tmp_path)
    for text in TEXTS:
        assert from_dir.encode(text) == theirs.encode(text)
    assert from_dir.eos_token_id == theirs.eos_token_id
    assert from_dir.apply_chat_template(CONVERSATIONS[1]) == theirs.apply_chat_template(
        CONVERSATIONS[1], add_generation_prompt=True, tokenize=False
    )


def test_chat_template_helpers_and_errors(tmp_path):
    from tiny_models import save_byte_tokenizer

    save_byte_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}"
        "{{ raise_exception('no tools') }}{% endif %}{{ m | tojson }}{% endfor %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.bos_token_id == 256 and tok.eos_token_id == 257
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == (
        '<s>{"role": "user", "content": "é"}'
    )
    with pytest.raises(Exception, match="no tools"):
        tok.apply_chat_template([{"role": "tool", "content": ""}])
    # The sandbox refuses attribute access to Python internals.
    tok2 = Tokenizer(tok.backend, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(Exception, match="unsafe|access"):
        tok2.apply_chat_template([])
    with pytest.raises(ValueError, match="chat_template"):
        Tokenizer(tok.backend).apply_chat_template([])
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path / "missing")
