"""The CPU executor (worker/kernels, formats, weights, attention, sampler, quality).

* fp32: the C++ layer loop and the pure-torch path give the same greedy tokens, with whole
  prompts (SDPA) and with small prefill chunks (attention through the pool); the fp32
  engine against transformers is tests/test_engine_vs_hf.py.
* gguf (the default where qgemm has a SIMD path: AVX2 or AVX-512): a request's logits are
  bit-identical alone and inside a batch; perplexity on the shipped text within 2 % of fp32;
  greedy agreement (the question list: tests/test_default_format.py).
* the qgemm kernel against the dequantized matrix, for each block type it takes, and its
  SIMD path bit-identical to its scalar reference at every row count.
* the fallbacks: a failed kernel build (no compiler) warns and the torch path runs; a
  format the machine lacks falls back with a logged warning; a block type the fast path
  lacks is stored dense.
* the batched sampler against the full-sort definition, batch independence, seeds.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from common.contracts import ScheduledChunk
from common.modelfile import resolve_model
from common.tokenizer import Tokenizer
from worker import kernels, sampler
from worker.attention import build_meta
from worker.build import add_format, load_model
from worker.formats import FORMATS, QUALITY_TOLERANCE, Capabilities, candidates, kv_dtype
from worker.model import LlamaModel
from worker.quality import perplexity, text
from worker.quant import RawMatrix, dequantize, pack_qgemm
from worker.weights import MatrixSource, make_linear

BS = 16
NEW = 16
PROMPTS = [
    "Hello",
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a land far away, there lived a",
    "Q: What is 12 * 7?\nA:",
    "A very long prompt. " + "The quick brown fox jumps over the lazy dog. " * 12,
]
ROOT = Path(__file__).resolve().parents[1]

ops = kernels.load()
needs_kernels = pytest.mark.skipif(ops is None, reason="the C++ kernels did not build here")
needs_qgemm = pytest.mark.skipif(ops is None or ops.qgemm_isa() == "scalar",
                                 reason="qgemm has no SIMD path on this CPU")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_source(resolve_model(None))


@pytest.fixture(scope="module")
def lm() -> LlamaModel:
    src = resolve_model(None)
    model = load_model(src, ops)
    caps = Capabilities.detect(ops, src.kind)
    add_format(model, FORMATS["float32"], caps)
    if caps.qgemm:
        add_format(model, FORMATS["gguf"], caps)
    return model


def pool(model: LlamaModel, dtype: torch.dtype, blocks: int = 256) -> torch.Tensor:
    c = model.cfg
    return torch.zeros((blocks, c.num_layers, 2, BS, c.num_kv_heads, c.head_dim), dtype=dtype)


@dataclass
class Seq:
    rid: str
    ids: list[int]
    table: list[int]
    done: int = 0  # tokens whose KV is in the pool
    out: list[int] | None = None


def generate(model: LlamaModel, weights: str, kv: torch.Tensor, prompts: list[list[int]],
             chunk: int = 512, new: int = NEW, logits_out: list[torch.Tensor] | None = None
             ) -> list[list[int]]:
    """Greedy tokens of every prompt, all in one batch per step: prefill in chunks of
    `chunk` tokens, then `new - 1` decode steps."""
    per = 1 + (max(len(p) for p in prompts) + new) // BS + 1
    seqs = [Seq(f"r{i}", list(p), list(range(1 + i * per, 1 + (i + 1) * per)), out=[])
            for i, p in enumerate(prompts)]
    while any(s.done < len(s.ids) for s in seqs):
        chunks = []
        for s in seqs:
            if s.done < len(s.ids):
                part = s.ids[s.done: s.done + chunk]
                chunks.append(ScheduledChunk(s.rid, part, s.done, s.table,
                                             s.done + len(part) == len(s.ids)))
        logits = model.forward(weights, build_meta(chunks, BS), kv)
        if logits_out is not None:
            logits_out.append(logits)
        by_id = {s.rid: s for s in seqs}
        row = 0
        for c in chunks:
            s = by_id[c.request_id]
            s.done += len(c.token_ids)
            if c.sample and len(s.out or []) < new:
                t = int(logits[row].argmax())
                row += 1
                assert s.out is not None
                s.out.append(t)
                if len(s.out) < new:
                    s.ids.append(t)
            elif c.sample:
                row += 1
    return [s.out or [] for s in seqs]


@pytest.fixture(scope="module")
def prompt_ids(tok: Tokenizer) -> list[list[int]]:
    return [tok.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def fp32_ref(lm: LlamaModel, prompt_ids: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of the pure-torch fp32 path (whole-prompt prefill)."""
    saved, lm.ops = lm.ops, None
    try:
        return generate(lm, "float32", pool(lm, torch.float32), prompt_ids)
    finally:
        lm.ops = saved


@needs_kernels
@pytest.mark.parametrize("chunk", [512, 5])
def test_fp32_cpp_loop_equals_torch_path(lm: LlamaModel, prompt_ids: list[list[int]],
                                         fp32_ref: list[list[int]], chunk: int) -> None:
    got = generate(lm, "float32", pool(lm, torch.float32), prompt_ids, chunk=chunk)
    assert got == fp32_ref


def test_fp32_torch_path_chunked_equals_whole(lm: LlamaModel, prompt_ids: list[list[int]],
                                              fp32_ref: list[list[int]]) -> None:
    saved, lm.ops = lm.ops, None
    try:
        got = generate(lm, "float32", pool(lm, torch.float32), prompt_ids, chunk=7)
    finally:
        lm.ops = saved
    assert got == fp32_ref


@needs_qgemm
def test_gguf_batch_invariance(lm: LlamaModel, prompt_ids: list[list[int]]) -> None:
    """Row-independent kernels with a fixed reduction order: a request's logits do not
    depend on the batch around it (what lossless rotation and recompute rely on)."""
    batched: list[torch.Tensor] = []
    toks = generate(lm, "gguf", pool(lm, torch.bfloat16), prompt_ids, new=6, logits_out=batched)
    for i, ids in enumerate(prompt_ids):
        alone: list[torch.Tensor] = []
        assert generate(lm, "gguf", pool(lm, torch.bfloat16), [ids], new=6,
                        logits_out=alone) == [toks[i]]
        # the last step is a pure decode batch: one row per request, in prompt order
        assert torch.equal(alone[-1][0], batched[-1][i])


@needs_qgemm
def test_gguf_quality_within_bound(lm: LlamaModel, tok: Tokenizer,
                                   prompt_ids: list[list[int]],
                                   fp32_ref: list[list[int]]) -> None:
    ids = tok.encode(text())[:1024]
    ref = perplexity(lm, "float32", ids, kv_dtype(FORMATS["float32"]))
    got = perplexity(lm, "gguf", ids, kv_dtype(FORMATS["gguf"]))
    assert ref.tokens == got.tokens > 1000
    assert 5.0 < ref.ppl < 60.0  # the text and the model are what they should be
    assert got.ppl <= ref.ppl * (1 + QUALITY_TOLERANCE), (got.ppl, ref.ppl)
    top1 = float((got.top1 == ref.top1).float().mean())
    assert top1 > 0.9, top1
    # greedy generations: most tokens agree with fp32 (quantized weights may diverge late)
    gen = generate(lm, "gguf", pool(lm, torch.bfloat16), prompt_ids)
    first = [a[0] == b[0] for a, b in zip(gen, fp32_ref)]
    assert sum(first) >= len(first) - 1


def _packed(kind: str, n: int, k: int, seed: int = 1
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(dense dequantized [n, k], codes, scales, bits) of a random matrix in `kind` blocks."""
    from gguf import GGMLQuantizationType, quants

    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    data = quants.quantize(w, GGMLQuantizationType[kind])
    raw = RawMatrix(kind, n, k, np.ascontiguousarray(data).reshape(n, -1))
    codes, scales, bits = pack_qgemm(raw)
    return dequantize(raw), codes, scales, bits


@needs_kernels
@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0", "Q8_0"])
def test_qgemm_reference_matches_dequantized_matmul(kind: str) -> None:
    """The packed layout and the arithmetic (int16 activations per 32 values), on any CPU."""
    assert ops is not None
    dense, codes, scales, bits = _packed(kind, 48, 256)
    x = torch.from_numpy(np.random.default_rng(2).standard_normal((5, 256)).astype(np.float32))
    want = x @ dense.T
    got = ops.qgemm(x, codes, scales, bits, 48, reference=True)
    # int16 activations: each value within max|x| / 65534 of its block's maximum
    err = float((got - want).abs().max() / want.abs().max())
    assert err < 2e-4, err


@needs_qgemm
@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0", "Q8_0"])
def test_qgemm_simd_is_bit_identical_to_reference(kind: str) -> None:
    """Every row-block shape the SIMD path dispatches to (M = 1..17, 33) and a column
    count that leaves odd tiles: the same integers and fp32 operations in the same order as
    the scalar reference, so the AVX2 and AVX-512 paths agree with it bit for bit."""
    assert ops is not None
    n, k = 80, 192
    _, codes, scales, bits = _packed(kind, n, k)
    rng = np.random.default_rng(3)
    for m in [*range(1, 18), 33]:
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
        x[0, :32] = 0  # an all-zero block (scale 0)
        got = ops.qgemm(x, codes, scales, bits, n)
        ref = ops.qgemm(x, codes, scales, bits, n, reference=True)
        assert torch.equal(got, ref), (m, float((got - ref).abs().max()))
        # a row's result does not depend on the rows around it
        assert torch.equal(ops.qgemm(x[-1:], codes, scales, bits, n)[0], got[-1])


def test_unsupported_block_type_is_stored_dense() -> None:
    dense = torch.randn(32, 64)
    raw = RawMatrix("Q6_K", 32, 64, np.zeros((32, 64), dtype=np.uint8))
    lin = make_linear(MatrixSource(lambda: dense, raw), "gguf", torch.float32)
    assert lin.fmt == "fp32" and torch.equal(lin.w, dense)  # dequantized, kept exactly
    lin = make_linear(MatrixSource(lambda: dense, raw), "gguf", torch.bfloat16)
    assert lin.fmt == "bf16" and torch.equal(lin.w, dense.bfloat16())
    # int4 re-quantizes what has no 4-bit blocks (lossy, like Q4_1)
    assert make_linear(MatrixSource(lambda: dense, raw), "int4", torch.float32).fmt == "int4"


def test_explicit_format_the_machine_lacks_falls_back() -> None:
    bare = Capabilities(kernels=False, qgemm=False, bf16=False, int4pack=True, gguf_source=True)
    assert [f.name for f in candidates("bfloat16", bare)] == ["float32"]
    assert [f.name for f in candidates("gguf", bare)] == ["float32"]
    assert [f.name for f in candidates("auto", bare)] == ["float32"]
    with pytest.raises(ValueError, match="unknown --dtype"):
        candidates("float8", bare)


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env={**os.environ, **env})


def test_failed_kernel_build_warns_and_returns_none(tmp_path: Path) -> None:
    """No compiler: one warning, None, and the executor's torch path is used."""
    p = _run("from worker import kernels; print(kernels.load() is None)",
             SUPERINFER_KERNELS_DIR=str(tmp_path), CXX="/nonexistent/g++")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "True"
    assert "kernels_unavailable" in p.stdout + p.stderr


def test_generate_without_kernels_falls_back(tmp_path: Path) -> None:
    """--dtype gguf on a machine without the kernels: a logged fallback, the same greedy
    text as float32 where the fallback is float32 (no native bf16)."""
    cmd = [sys.executable, "-m", "superinfer.cli", "generate", "--prompt",
           "The capital of France is", "--max-tokens", "8", "--json", "--device-blocks", "64"]
    env = {**os.environ, "SUPERINFER_NO_KERNELS": "1", "XDG_CACHE_HOME": str(tmp_path)}
    p = subprocess.run([*cmd, "--dtype", "gguf"], capture_output=True, text=True, timeout=600,
                       cwd=ROOT, env=env)
    assert p.returncode == 0, p.stderr
    assert "dtype_fallback" in p.stderr
    out = json.loads(p.stdout.splitlines()[0])
    assert len(out["token_ids"]) == 8
    if not Capabilities.detect(None, "gguf").bf16:
        ref = subprocess.run([*cmd, "--dtype", "float32"], capture_output=True, text=True,
                             timeout=600, cwd=ROOT, env=env)
        assert json.loads(ref.stdout.splitlines()[0])["token_ids"] == out["token_ids"]


# -- the sampler -----------------------------------------------------------------------
@dataclass
class Row:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    output_index: int = 0


def full_sort_pick(x: torch.Tensor, r: Row, u: float) -> int:
    """The definition: temperature, top-k (ties with the k-th kept), top-p over what is
    left (the smallest sorted prefix whose mass reaches p), inverse CDF with u."""
    x = x / r.temperature
    if r.top_k <= 0 and r.top_p >= 1.0:  # no filter: the inverse CDF in vocabulary order
        c = torch.softmax(x, -1).cumsum(-1)
        return int(torch.searchsorted(c, torch.tensor([u * float(c[-1])]), right=True)
                   .clamp_max(len(c) - 1))
    if r.top_k > 0:
        kth = torch.topk(x, min(r.top_k, x.shape[0])).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    sx, idx = torch.sort(x, descending=True)
    probs = torch.softmax(sx, -1)
    if r.top_p < 1.0:
        probs = probs.masked_fill(probs.cumsum(-1) - probs > r.top_p, 0.0)
    c = probs.cumsum(-1)
    j = int(torch.searchsorted(c, torch.tensor([u * float(c[-1])]), right=True)
            .clamp_max(len(c) - 1))
    return int(idx[j])


@pytest.fixture(scope="module")
def sample_rows() -> tuple[torch.Tensor, list[Row]]:
    rnd = random.Random(0)
    torch.manual_seed(0)
    rows = [Row(temperature=rnd.choice([0.5, 0.8, 1.0, 1.3]),
                top_p=rnd.choice([1.0, 0.9, 0.95, 0.5, 0.99]),
                top_k=rnd.choice([0, 0, 20, 50, 1000]), seed=1234 + i, output_index=i % 7)
            for i in range(160)]
    rows += [Row(temperature=0.0), Row(top_k=1, seed=3)]  # greedy rows
    scale = torch.tensor([rnd.choice([0.05, 1.0, 3.0, 8.0]) for _ in rows])  # 0.05: ~flat
    return torch.randn(len(rows), 49152) * scale[:, None], rows


def test_sampler_equals_full_sort_definition(sample_rows: tuple[torch.Tensor, list[Row]]
                                             ) -> None:
    logits, rows = sample_rows
    got = sampler.sample_tokens(logits, rows)
    u = sampler.uniforms(rows)
    for i, (t, r) in enumerate(zip(got, rows)):
        want = int(logits[i].argmax()) if r.temperature == 0 or r.top_k == 1 \
            else full_sort_pick(logits[i], r, float(u[i]))
        assert t == want, (i, r)


def test_sampler_rows_do_not_depend_on_the_batch(sample_rows: tuple[torch.Tensor, list[Row]]
                                                 ) -> None:
    logits, rows = sample_rows
    batched = sampler.sample_tokens(logits, rows)
    perm = list(range(len(rows)))
    random.Random(1).shuffle(perm)
    shuffled = sampler.sample_tokens(logits[perm], [rows[i] for i in perm])
    assert [shuffled[perm.index(i)] for i in range(len(rows))] == batched
    alone = [sampler.sample_tokens(logits[i: i + 1], [r])[0] for i, r in enumerate(rows[:24])]
    assert alone == batched[:24]


def test_sampler_seed_and_step_set_the_draw() -> None:
    a = sampler.uniforms([Row(seed=7, output_index=3), Row(seed=7, output_index=4),
                          Row(seed=8, output_index=3)])
    b = sampler.uniforms([Row(seed=7, output_index=3)])
    assert a[0] == b[0] and len({*a.tolist()}) == 3
    assert ((a >= 0) & (a < 1)).all()
