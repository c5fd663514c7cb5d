"""The GGUF-built tokenizer must produce the reference ids, text and chat prompts.

The reference is transformers loading the same GGUF file; any difference in ids would
change what the model sees, so every case is compared exactly.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from common.errors import InvalidRequestError
from common.modelfile import resolve_model
from common.tokenizer import Tokenizer

STRINGS = [
    "Hello world",
    "Hello, world!",
    "hello world",
    "HELLO WORLD",
    " leading space",
    "  two leading spaces",
    "trailing space ",
    "trailing spaces   ",
    "multiple   spaces   inside",
    "line one\nline two",
    "para one\n\npara two",
    "\n\n\nthree newlines first",
    "ends with newline\n",
    "tab\tseparated\tvalues",
    "\t\tleading tabs",
    "mixed \t \n whitespace \r\n windows",
    "12345",
    "3.14",
    "pi is 3.14159 and e is 2.71828",
    "1,000,000 dollars",
    "The year 2024 had 366 days.",
    "x = 42 + 17 * (3 - 1)",
    "-0.5e-10",
    "phone: +1 (555) 123-4567",
    "def add(a, b):\n    return a + b\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "import numpy as np\nx = np.zeros((3, 4), dtype=np.float32)",
    '{"key": "value", "list": [1, 2, 3], "nested": {"a": null}}',
    '<div class="main">Hello</div>',
    "SELECT * FROM users WHERE id = 1;",
    "https://example.com/path?query=1&other=two#frag",
    "user@example.com",
    "I'm sure you'll see they've done it, haven't they?",
    "don't won't can't shouldn't",
    "Emoji: 😀🎉👍🏽",
    "👨‍👩‍👧‍👦 family",
    "🇫🇷 flag",
    "中文测试：你好，世界！",
    "我喜欢用Python编程。",
    "日本語のテキストです。",
    "カタカナとひらがな",
    "한국어 텍스트입니다",
    "안녕하세요 세계",
    "مرحبا بالعالم",
    "النص العربي من اليمين إلى اليسار",
    "Привет, мир!",
    "Ελληνικά γράμματα",
    "हिन्दी पाठ",
    "Café naïve résumé façade",
    "Straße über Ärger",
    "math: ∑ ∫ √ ∞ ≠ ≤ ≥ π",
    "arrows → ← ↑ ↓ and “quotes” ‘single’ — dash … ellipsis",
    "<|im_start|>",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "text before <|im_end|> text after",
    "<|endoftext|>",
    "<repo_name>my/repo<file_sep>main.py",
    "<|im_start|> with space after",
    "not a special <|im_start token",
    "a",
    " ",
    "\n",
    "",
    "!!!???...",
    "$$$ %%% ^^^ &&&",
    "CamelCaseIdentifier snake_case_identifier kebab-case-identifier",
    "A" * 50,
    "abc" * 20 + " " + "0123456789" * 3,
    "Mixed 中文 and English and 日本語 and 123 and 😀.",
    "\u00a0non-breaking\u00a0space",
    "zero\u200bwidth",
]

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Say hi."},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about 12345 and 3.14."},
    ],
    [
        {"role": "system", "content": "Réponds en français. 😀"},
        {"role": "user", "content": "Bonjour\n\nça va ?"},
        {"role": "assistant", "content": "Oui, merci."},
        {"role": "user", "content": "中文呢？"},
    ],
]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return Tokenizer.from_source(resolve_model(None))


@pytest.fixture(scope="module")
def reference() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    path = resolve_model(None).path
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_model_facts(ours: Tokenizer) -> None:
    assert ours.vocab_size == 49152
    assert ours.eos_token_ids == [2]
    assert ours.token_text(2) == "<|im_end|>"
    assert ours.bos_token_id == 1
    assert {0, 1, 2} <= ours.special_ids
    assert len(STRINGS) >= 60


@pytest.mark.parametrize("text", STRINGS)
def test_ids_match_transformers(ours: Tokenizer, reference: Any, text: str) -> None:
    assert ours.encode(text) == reference.encode(text)


@pytest.mark.parametrize("text", STRINGS)
def test_decode_round_trips(ours: Tokenizer, reference: Any, text: str) -> None:
    ids = ours.encode(text)
    assert ours.decode(ids) == text
    assert ours.decode(ids, skip_special_tokens=True) == reference.decode(
        ids, skip_special_tokens=True
    )


@pytest.mark.parametrize("text", STRINGS)
def test_incremental_detokenizer_reassembles_decode(ours: Tokenizer, text: str) -> None:
    ids = ours.encode(text)
    detok = ours.detokenizer()
    deltas = [detok.feed([i]) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == ours.decode(ids, skip_special_tokens=True)
    # No delta may carry half a character.
    assert all("\ufffd" not in d for d in deltas)


def test_incremental_detokenizer_holds_back_split_characters(ours: Tokenizer) -> None:
    ids = ours.encode("😀")
    assert len(ids) > 1, "the emoji should span several byte-level tokens"
    detok = ours.detokenizer()
    assert [detok.feed([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.feed(ids[-1:]) == "😀"


def test_incremental_detokenizer_flushes_incomplete_tail(ours: Tokenizer) -> None:
    partial = ours.encode("😀")[:-1]
    detok = ours.detokenizer()
    assert detok.feed(ours.encode("ok ") + partial) == "ok "
    assert detok.flush() == ours.decode(partial)
    assert detok.flush() == ""


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    ours: Tokenizer, reference: Any, messages: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    expected = reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == expected
    assert ours.encode(text, add_special_tokens=False) == reference.encode(
        expected, add_special_tokens=False
    )


def test_chat_template_adds_default_system_prompt(ours: Tokenizer) -> None:
    text = ours.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>assistant\n")


def test_chat_template_bad_messages_are_invalid_requests(ours: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError):
        ours.apply_chat_template([{"content": "no role"}])


def test_template_raise_exception_is_invalid_request() -> None:
    from common.chat_template import render_chat_template

    source = "{% if messages|length == 0 %}{{ raise_exception('empty conversation') }}{% endif %}"
    with pytest.raises(InvalidRequestError, match="empty conversation"):
        render_chat_template(source, [])


def test_template_sandbox_blocks_attribute_escapes() -> None:
    from common.chat_template import render_chat_template

    source = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(InvalidRequestError):
        render_chat_template(source, [])


@pytest.fixture(scope="module")
def from_hf_dir(reference: Any, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The same tokenizer saved the way a Hugging Face model directory holds it."""
    directory = tmp_path_factory.mktemp("hf-model")
    reference.save_pretrained(str(directory))
    (directory / "config.json").write_text("{}")
    return Tokenizer.from_source(resolve_model(str(directory)))


def test_hf_dir_tokenizer_matches(from_hf_dir: Tokenizer, ours: Tokenizer) -> None:
    assert from_hf_dir.eos_token_ids == ours.eos_token_ids
    assert from_hf_dir.vocab_size == ours.vocab_size
    assert from_hf_dir.special_ids == ours.special_ids
    for text in STRINGS:
        assert from_hf_dir.encode(text) == ours.encode(text), text
    for messages in CONVERSATIONS:
        assert from_hf_dir.apply_chat_template(messages) == ours.apply_chat_template(messages)


def test_incremental_detokenizer_on_random_ids_reassembles_decode(ours: Tokenizer) -> None:
    """Any id sequence (not only encodings of text: split characters, specials in the
    middle, ids fed in uneven groups) comes back as decode() once flushed."""
    import random

    rng = random.Random(7)
    specials = sorted(ours.special_ids)
    for _ in range(200):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 40))]
        if specials and rng.random() < 0.3:
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        detok = ours.detokenizer()
        deltas, i = [], 0
        while i < len(ids):
            n = rng.randrange(1, 4)
            deltas.append(detok.feed(ids[i : i + n]))
            i += n
        deltas.append(detok.flush())
        assert "".join(deltas) == ours.decode(ids, skip_special_tokens=True), ids
