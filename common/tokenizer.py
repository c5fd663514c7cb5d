"""Text ↔ token ids, chat templates and streaming detokenization.

One ``Tokenizer`` wraps a ``tokenizers.Tokenizer`` built either from a GGUF file's
metadata (the bundled model has no tokenizer.json) or from a Hugging Face model
directory. The GGUF build reproduces what llama.cpp and transformers do for a
byte-level BPE vocabulary, so ids match the reference model exactly.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from common.chat_template import render_chat_template
from common.errors import InvalidRequestError, ModelLoadError
from common.modelfile import ModelSource, read_gguf_metadata

# llama.cpp token types (gguf TokenType): only these two change tokenization.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# llama.cpp pre-tokenizer names (tokenizer.ggml.pre) whose split is "every digit alone,
# then the GPT-2 regex" and those whose split is the GPT-2 regex alone. Other names
# use splits not rebuilt here; such models load from a Hugging Face directory instead.
_PRE_DIGITS_THEN_GPT2 = {
    "smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b",
}  # fmt: skip
_PRE_GPT2 = {"default", "gpt-2", "gpt2", "phi-2", "jina-es", "jina-de", "roberta-bpe"}


class Tokenizer:
    """A model's tokenizer plus the facts the engine needs (EOS ids, chat template)."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        eos_token_ids: Sequence[int],
        bos_token_id: int | None = None,
        add_bos_token: bool | None = False,
        chat_template: str | None = None,
        template_vars: dict[str, Any] | None = None,
    ) -> None:
        """``add_bos_token=None`` leaves special tokens to the backend's post-processor."""
        self._tk = backend
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos_token_ids))
        self.bos_token_id = bos_token_id
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.special_ids: frozenset[int] = frozenset(
            i for i, t in backend.get_added_tokens_decoder().items() if t.special
        )
        self._template_vars = {
            "bos_token": self._token_text(bos_token_id),
            "eos_token": self._token_text(self.eos_token_ids[0] if self.eos_token_ids else None),
            **(template_vars or {}),
        }

    @property
    def backend(self) -> HFTokenizer:
        """The `tokenizers.Tokenizer` underneath."""
        return self._tk

    # -- constructors ---------------------------------------------------------------

    @classmethod
    def from_source(cls, source: ModelSource) -> Tokenizer:
        if source.kind == "gguf":
            return cls.from_gguf(source.path)
        return cls.from_hf_dir(source.path)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Byte-level BPE from ``tokenizer.ggml.*`` metadata, as llama.cpp builds it."""
        meta = read_gguf_metadata(path)
        kind = meta.get("tokenizer.ggml.model")
        pre = meta.get("tokenizer.ggml.pre", "default")
        if kind != "gpt2":
            raise ModelLoadError(
                f"model file {path}: GGUF tokenizer type {kind!r} is not supported (only byte-level "
                "BPE, 'gpt2'); load the model from its Hugging Face directory instead"
            )
        if pre not in _PRE_DIGITS_THEN_GPT2 and pre not in _PRE_GPT2:
            raise ModelLoadError(
                f"model file {path}: GGUF pre-tokenizer {pre!r} is not supported; "
                "load the model from its Hugging Face directory instead"
            )
        try:
            tokens: list[str] = meta["tokenizer.ggml.tokens"]
            merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
            token_types: list[int] = meta.get("tokenizer.ggml.token_type") or []
            eos = int(meta["tokenizer.ggml.eos_token_id"])
        except (KeyError, ValueError, TypeError) as e:
            raise ModelLoadError(f"model file {path}: tokenizer metadata incomplete ({e})") from e

        vocab = {tok: i for i, tok in enumerate(tokens)}
        tk = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre in _PRE_DIGITS_THEN_GPT2:
            tk.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        else:
            tk.pre_tokenizer = byte_level
        tk.decoder = decoders.ByteLevel()
        # Control tokens (<|im_start|> …) must match whole in text rather than be split
        # into bytes; user-defined ones too, but they are ordinary text when decoding.
        tk.add_special_tokens(
            [
                AddedToken(tok, special=True, normalized=False)
                for tok, ty in zip(tokens, token_types)
                if ty == _TOKEN_TYPE_CONTROL
            ]
        )
        tk.add_tokens(
            [
                AddedToken(tok, special=False, normalized=False)
                for tok, ty in zip(tokens, token_types)
                if ty == _TOKEN_TYPE_USER_DEFINED
            ]
        )
        # llama.cpp stops on any end-of-generation token, not just EOS.
        eog = [eos] + [
            int(meta[k])
            for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
            if k in meta
        ]
        bos = meta.get("tokenizer.ggml.bos_token_id")
        return cls(
            tk,
            eos_token_ids=eog,
            bos_token_id=int(bos) if bos is not None else None,
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(cls, directory: str | Path) -> Tokenizer:
        """tokenizer.json + tokenizer_config.json (+ generation_config.json EOS ids)."""
        d = Path(directory)
        tok_file = d / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(
                f"model directory {d}: no tokenizer.json; only fast (tokenizers) tokenizers "
                "are supported"
            )
        try:
            tk = HFTokenizer.from_file(str(tok_file))
        except Exception as e:
            raise ModelLoadError(f"model directory {d}: tokenizer.json is unreadable ({e})") from e
        config = _read_json(d / "tokenizer_config.json")
        gen_config = _read_json(d / "generation_config.json")

        def token_id(entry: Any) -> int | None:
            text = entry.get("content") if isinstance(entry, dict) else entry
            return tk.token_to_id(text) if isinstance(text, str) else None

        eos_ids: list[int] = []
        gen_eos = gen_config.get("eos_token_id")
        if isinstance(gen_eos, int):
            eos_ids.append(gen_eos)
        elif isinstance(gen_eos, list):
            eos_ids.extend(int(i) for i in gen_eos)
        cfg_eos = token_id(config.get("eos_token"))
        if cfg_eos is not None:
            eos_ids.insert(0, cfg_eos)
        if not eos_ids:
            raise ModelLoadError(
                f"model directory {d}: no EOS token in tokenizer_config.json or "
                "generation_config.json"
            )
        add_bos = config.get("add_bos_token")
        return cls(
            tk,
            eos_token_ids=eos_ids,
            bos_token_id=token_id(config.get("bos_token")),
            add_bos_token=bool(add_bos) if add_bos is not None else None,
            chat_template=_hf_chat_template(d, config),
        )

    # -- encoding -------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids for ``text``; special-token text such as ``<|im_start|>`` maps to its id.

        ``add_special_tokens=False`` is for text that already carries them (a rendered
        chat template writes its own BOS when the model wants one).
        """
        if self.add_bos_token is None:
            return list(self._tk.encode(text, add_special_tokens=add_special_tokens).ids)
        ids = list(self._tk.encode(text, add_special_tokens=False).ids)
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return str(self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str | None:
        """The vocabulary entry for one id (None if out of range)."""
        return self._token_text(token_id)

    def _token_text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._tk.id_to_token(token_id)

    # -- chat -----------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **variables: Any,
    ) -> str:
        """The prompt text for a conversation; encode it with ``add_special_tokens=False``."""
        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template; send a plain prompt")
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            **{**self._template_vars, **variables},
        )

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self)


class IncrementalDetokenizer:
    """Turns one request's stream of generated ids into text deltas.

    `tokenizers.decoders.DecodeStream` does the work: a character can span several
    byte-level tokens, and it releases text only once a token completes it (decoding
    against the tokens before, so that decoders that render a token differently at the
    start of a string stay right). Special tokens are dropped. ``flush`` releases what is
    still held back at the end of a stream (say, half of an emoji, as U+FFFD), so that
    concatenating every ``feed`` result and the final ``flush`` gives
    ``decode(ids, skip_special_tokens=True)``.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._stream = decoders.DecodeStream(skip_special_tokens=True)
        self._ids: list[int] = []
        self._released = 0  # characters of text released so far
        self._held = False  # ids were fed whose text is not released yet

    def feed(self, new_ids: Iterable[int]) -> str:
        """Add generated ids; return the text they complete (possibly empty)."""
        out = []
        backend = self._tok.backend
        for i in new_ids:
            self._ids.append(i)
            chunk = self._stream.step(backend, i)
            if chunk is None:
                self._held = True
            else:
                out.append(chunk)
                self._held = False
        text = "".join(out)
        self._released += len(text)
        return text

    def flush(self) -> str:
        """At the end of the stream, release whatever is held back (even a lone U+FFFD)."""
        if not self._held:
            return ""
        self._held = False
        tail = self._tok.decode(self._ids, skip_special_tokens=True)[self._released :]
        self._released += len(tail)
        return tail


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: unreadable JSON ({e})") from e
    return data if isinstance(data, dict) else {}


def _hf_chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    """transformers ≥ 4.43 may keep the template in chat_template.jinja; older in the config."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None
