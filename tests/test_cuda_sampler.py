"""Sampling on the device (worker/cuda/sampler.py), run on CPU tensors: the same ops.

What a user relies on: greedy is argmax; a seeded request gets the same token for the same
(seed, output_index) whatever else is in the batch; the draws follow softmax(logits / T);
top-k and top-p never yield a token outside their set.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from worker.cuda.sampler import _mul32, sample_tokens, uniform


@dataclass
class Row:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = 0
    output_index: int = 0


def test_mul32_is_exact_where_int64_would_overflow() -> None:
    xs = torch.tensor([0, 1, 0xFFFFFFFF, 0x12345678, 0xDEADBEEF], dtype=torch.int64)
    for c in (0x7FEB352D, 0x846CA68B):
        assert _mul32(xs, c).tolist() == [(int(x) * c) & 0xFFFFFFFF for x in xs]


def test_greedy_rows_are_argmax_beside_random_rows() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    rows = [Row(temperature=0.0), Row(seed=3), Row(top_k=1), Row(temperature=0.0, seed=None)]
    out = sample_tokens(logits, rows)
    am = logits.argmax(-1).tolist()
    assert out[0] == am[0] and out[2] == am[2] and out[3] == am[3]


def test_seeded_draw_depends_only_on_seed_and_output_index() -> None:
    g = torch.Generator().manual_seed(1)
    target = torch.randn(1, 300, generator=g)
    alone = sample_tokens(target, [Row(seed=42, output_index=7)])[0]
    others = torch.randn(5, 300, generator=g)
    batch = torch.cat([others[:2], target, others[2:]])
    rows = [Row(seed=s) for s in (1, 2)] + [Row(seed=42, output_index=7)] + \
        [Row(seed=None), Row(seed=42, output_index=8), Row(temperature=0.0)]
    assert sample_tokens(batch, rows)[2] == alone
    assert sample_tokens(target, [Row(seed=42, output_index=7)])[0] == alone  # repeatable
    draws = {sample_tokens(target, [Row(seed=42, output_index=i)])[0] for i in range(40)}
    assert len(draws) > 10  # the output index moves the stream on


def test_draws_follow_the_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    n = 6000
    rows = [Row(temperature=0.8, seed=s) for s in range(n)]
    tokens = torch.tensor(sample_tokens(logits.expand(n, 5).contiguous(), rows))
    freq = torch.bincount(tokens, minlength=5).float() / n
    p = torch.softmax(logits[0] / 0.8, -1)
    # 4 standard errors: fails by chance far less than once in 10,000 runs
    assert ((freq - p).abs() <= 4 * (p * (1 - p) / n).sqrt() + 1e-3).all(), (freq, p)


def test_top_k_and_top_p_stay_inside_their_sets() -> None:
    logits = torch.tensor([[3.0, 2.9, 2.8, 0.0, -1.0, -2.0]]).expand(400, 6).contiguous()
    top2 = sample_tokens(logits, [Row(top_k=2, seed=s) for s in range(400)])
    assert set(top2) == {0, 1}
    p = torch.softmax(logits[0], -1)
    # the smallest prefix with mass >= 0.5: tokens 0 and 1 (p0 < 0.5 <= p0 + p1)
    assert p[0] < 0.5 <= p[0] + p[1]
    nucleus = sample_tokens(logits, [Row(top_p=0.5, seed=s) for s in range(400)])
    assert set(nucleus) == {0, 1}
    both = sample_tokens(logits, [Row(top_k=3, top_p=0.99, seed=s, temperature=2.0)
                                  for s in range(400)])
    assert set(both) == {0, 1, 2}


def test_uniforms_are_in_the_open_interval_and_look_uniform() -> None:
    u = uniform(torch.tensor([0, 1, (1 << 63) - 1]), 20000)
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005


def test_row_count_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="logit rows"):
        sample_tokens(torch.zeros(2, 5), [Row()])
