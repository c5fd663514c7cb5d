"""Model paths resolve to the right kind, and bad ones fail with a message that helps."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.errors import ModelLoadError
from common.modelfile import bundled_model_path, read_gguf_metadata, resolve_model


def test_bundled_model_is_found() -> None:
    path = bundled_model_path()
    assert path.suffix == ".gguf" and path.is_file()
    source = resolve_model(None)
    assert source.kind == "gguf" and source.path == path


def test_bundled_metadata_facts() -> None:
    meta = read_gguf_metadata(bundled_model_path())
    assert meta["general.architecture"] == "llama"
    assert meta["llama.block_count"] == 30
    assert meta["llama.attention.head_count_kv"] == 3
    assert meta["llama.rope.freq_base"] == pytest.approx(1e5)
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert len(meta["tokenizer.ggml.tokens"]) == 49152
    assert "<|im_start|>" in meta["tokenizer.chat_template"]


def test_hf_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    source = resolve_model(str(tmp_path))
    assert source.kind == "hf" and source.name == tmp_path.name


@pytest.mark.parametrize("name", ["missing.gguf", "dir-without-config", "weights.bin"])
def test_bad_paths(tmp_path: Path, name: str) -> None:
    (tmp_path / "dir-without-config").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="model path .*: (not found|not a GGUF file)"):
        resolve_model(str(tmp_path / name))


@pytest.mark.parametrize(
    "content", [b"", b"not a gguf file at all", b"GGUF\x03\x00\x00\x00\xff\xff\xff\xff"]
)
def test_corrupt_gguf_is_a_model_load_error(tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file") as info:
        read_gguf_metadata(bad)
    assert "\n" not in str(info.value)


def test_truncated_gguf_is_a_model_load_error(tmp_path: Path) -> None:
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(bundled_model_path().read_bytes()[:100_000])
    with pytest.raises(ModelLoadError):
        read_gguf_metadata(bad)
