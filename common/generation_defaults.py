"""The sampling a request gets for the fields it leaves unset, as vLLM chooses them.

`--generation-config` has vLLM's shape:

* ``auto`` (default): the model's own defaults: a GGUF file's ``general.sampling.*``
  metadata, or the ``generation_config.json`` beside a Hugging Face model; where the files
  carry none, the settings the model's authors publish for it (`PUBLISHED`); else OpenAI's.
* ``vllm``: OpenAI's defaults (temperature 1, top_p 1), whatever the model says.
* a folder: the ``generation_config.json`` in it.

Only the fields a request leaves unset take these values; a field it sets is its own.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import InvalidRequestError
from common.modelfile import ModelSource, read_gguf_metadata

MODES = ("auto", "vllm")  # or a folder


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    source: str = "OpenAI's defaults"

    def as_dict(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "repetition_penalty": self.repetition_penalty, "source": self.source}


# Settings a model's authors publish where its files carry none: (name pattern, values,
# where they are published). The pattern matches the model's name (the file's stem or
# its GGUF general.name / basename + finetune).
PUBLISHED: list[tuple[str, dict[str, float], str]] = [
    (r"smollm2.*instruct", {"temperature": 0.2, "top_p": 0.9},
     "the SmolLM2-Instruct model card's generate() example"),
]

_GGUF_KEYS = {"temperature": "general.sampling.temp", "top_p": "general.sampling.top_p",
              "top_k": "general.sampling.top_k",
              "repetition_penalty": "general.sampling.penalty_repeat"}
_HF_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")


def _build(values: dict[str, Any], source: str) -> GenerationDefaults:
    d = GenerationDefaults()

    def get(key: str, default: float) -> float:
        value = values.get(key)
        return default if value is None else float(value)

    return GenerationDefaults(
        temperature=get("temperature", d.temperature), top_p=get("top_p", d.top_p),
        top_k=int(get("top_k", d.top_k)),
        repetition_penalty=get("repetition_penalty", d.repetition_penalty), source=source)


def _from_generation_config(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InvalidRequestError(f"{path}: cannot read it as JSON ({e})") from None
    if not isinstance(data, dict):
        raise InvalidRequestError(f"{path}: expected a JSON object")
    return {k: data[k] for k in _HF_KEYS if k in data}


def _published(names: list[str]) -> tuple[dict[str, float], str] | None:
    for pattern, values, where in PUBLISHED:
        if any(re.search(pattern, n, re.IGNORECASE) for n in names if n):
            return values, where
    return None


def model_defaults(source: ModelSource) -> GenerationDefaults:
    """`auto`: the model's files, then its authors' published settings, then OpenAI's."""
    names = [source.name]
    if source.kind == "gguf":
        meta = read_gguf_metadata(source.path)
        found = {k: meta[key] for k, key in _GGUF_KEYS.items() if key in meta}
        if found:
            return _build(found, f"{source.path.name}: general.sampling metadata")
        names += [str(meta.get("general.name", "")),
                  f"{meta.get('general.basename', '')} {meta.get('general.finetune', '')}"]
    else:
        config = source.path / "generation_config.json"
        if config.is_file():
            found = _from_generation_config(config)
            if found:
                return _build(found, str(config))
    published = _published(names)
    if published is not None:
        values, where = published
        return _build(values, where)
    return GenerationDefaults()


def check_mode(mode: str) -> None:
    """A `--generation-config` value that cannot work: ValueError naming it."""
    if mode not in MODES and not (Path(mode).expanduser() / "generation_config.json").is_file():
        raise ValueError(f"--generation-config {mode}: expected auto, vllm or a folder "
                         "holding generation_config.json")


def resolve(mode: str, source: ModelSource) -> GenerationDefaults:
    """The defaults `--generation-config MODE` puts in force for this model."""
    if mode == "vllm":
        return GenerationDefaults(source="OpenAI's defaults (--generation-config vllm)")
    if mode == "auto":
        return model_defaults(source)
    folder = Path(mode).expanduser()
    config = folder / "generation_config.json"
    if not config.is_file():
        raise InvalidRequestError(
            f"--generation-config {mode}: expected auto, vllm or a folder holding "
            "generation_config.json")
    return _build(_from_generation_config(config), str(config))
