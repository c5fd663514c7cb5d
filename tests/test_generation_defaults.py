"""--generation-config: where a request's unset sampling fields come from (vLLM's rules)."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from common.errors import InvalidRequestError
from common.generation_defaults import check_mode, model_defaults, resolve
from common.modelfile import ModelSource, resolve_model


def _gguf(path: Path, name: str, **sampling: float) -> ModelSource:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    for key, value in sampling.items():
        w.add_float32(f"general.sampling.{key}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ModelSource(kind="gguf", path=path, name=path.stem)


def test_the_bundled_model_gets_its_authors_published_settings() -> None:
    d = resolve("auto", resolve_model(None))
    assert (d.temperature, d.top_p, d.top_k) == (0.2, 0.9, 0)
    assert "SmolLM2" in d.source
    assert resolve("vllm", resolve_model(None)).temperature == 1.0


def test_a_gguf_files_own_sampling_metadata_wins(tmp_path: Path) -> None:
    d = model_defaults(_gguf(tmp_path / "m.gguf", "SmolLM2 135M Instruct", temp=0.6, top_p=0.95))
    assert (d.temperature, d.top_p) == pytest.approx((0.6, 0.95))
    assert "general.sampling" in d.source
    plain = model_defaults(_gguf(tmp_path / "other.gguf", "Some Base Model"))
    assert (plain.temperature, plain.top_p) == (1.0, 1.0)  # nothing known: OpenAI's


def test_a_bad_mode_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--generation-config /nope"):
        check_mode("/nope")
    (tmp_path / "generation_config.json").write_text("not json")
    check_mode(str(tmp_path))  # the file is there: read (and refused) when the model loads
    with pytest.raises(InvalidRequestError, match="cannot read it as JSON"):
        resolve(str(tmp_path), resolve_model(None))
