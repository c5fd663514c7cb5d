"""The CUDA path's model and runner (worker/cuda/), run on the CPU with its Triton kernels
under the interpreter, against transformers' LlamaForCausalLM on the same random weights.

A tiny Llama (2 layers, GQA 4:2, Llama-3 RoPE scaling) runs a realistic sequence of batches
through `CudaModelRunner`: fresh prompts, a prompt split into chunks (the second one over
its cached prefix), decodes mixed with prefill, on scattered block tables. Every sampled
row's logits must equal the reference's at that position. Padding a decode batch to a CUDA
graph bucket must not change the real rows' logits, nor write KV anywhere.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and Triton's interpreter is off", allow_module_level=True)

from common.contracts import ScheduledChunk  # noqa: E402
from worker.cuda.batch import build_batch  # noqa: E402
from worker.cuda.graphs import GraphPlan  # noqa: E402
from worker.cuda.model import CudaLlama  # noqa: E402
from worker.cuda.random_model import random_weights, tiny_config  # noqa: E402
from worker.cuda.runner import CudaModelRunner  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BS = 4  # tokens per KV block


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return random_weights(tiny_config(), torch.device("cpu"), torch.float32, seed=7, std=0.2)


@pytest.fixture(scope="module")
def hf_logits(weights: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    cfg = tiny_config()
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={"rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {})},
        tie_word_embeddings=False, attention_bias=False)
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    names = {"embed_tokens": "model.embed_tokens.weight", "norm": "model.norm.weight",
             "lm_head": "lm_head.weight"}
    hf = {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm",
          **{p: f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
          **{p: f"mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")}}
    state = {}
    for k, v in weights.items():
        if k.startswith("layers."):
            _, i, part = k.split(".", 2)
            state[f"model.layers.{i}.{hf[part]}.weight"] = v
        else:
            state[names[k]] = v
    model.load_state_dict(state, strict=True)

    def logits(ids: list[int]) -> torch.Tensor:  # [len, V]
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0].float()

    return logits


def chunk(rid: str, ids: list[int], start: int, table: list[int], sample: bool = True
          ) -> ScheduledChunk:
    return ScheduledChunk(rid, ids, start, table, sample, temperature=0.0)


def test_runner_matches_transformers_over_prefill_chunks_and_decodes(
        weights: dict[str, torch.Tensor], hf_logits) -> None:  # type: ignore[no-untyped-def]
    cfg = tiny_config()
    rng = np.random.default_rng(0)
    prompts = {r: rng.integers(0, cfg.vocab_size, n).tolist()
               for r, n in (("a", 7), ("b", 13), ("c", 5))}
    tables = {"a": [9, 2, 14], "b": [5, 11, 0, 7, 3], "c": [12, 6, 15]}  # scattered
    pool = torch.zeros((16, cfg.num_layers, 2, BS, cfg.num_kv_heads, cfg.head_dim),
                       device=DEVICE)
    # Key tiles of 16: the decodes below split their context in two (flash-decoding); b's
    # second half fills as it grows, a's and c's stays empty.
    model = CudaLlama(cfg, dict(weights), DEVICE, torch.float32, decode_block_n=16)
    runner = CudaModelRunner(model, pool, BS, max_batch=8)
    seqs = {r: list(p) for r, p in prompts.items()}
    worst = 0.0

    def decode(r: str) -> ScheduledChunk:
        return chunk(r, [seqs[r][-1]], len(seqs[r]) - 1, tables[r])

    def run(step: list[ScheduledChunk]) -> None:
        nonlocal worst
        got = runner.logits(step).cpu()  # on a GPU decodes replay the CUDA graphs
        rows = [c for c in step if c.sample]
        assert got.shape[0] == len(rows)
        for c, row in zip(rows, got, strict=True):
            want = hf_logits(seqs[c.request_id][: c.start_pos + len(c.token_ids)])[-1]
            worst = max(worst, (row - want).abs().max().item())
            seqs[c.request_id].append(int(want.argmax()))  # the greedy continuation

    # fresh a and c; b's first 8 tokens (no sample: not its last chunk)
    run([chunk("a", seqs["a"], 0, tables["a"]), chunk("b", seqs["b"][:8], 0, tables["b"], False),
         chunk("c", seqs["c"], 0, tables["c"])])
    # decodes beside b's last 5 prompt tokens over its cached 8
    run([decode("a"), chunk("b", seqs["b"][8:], 8, tables["b"]), decode("c")])
    run([decode(r) for r in "abc"])
    run([decode(r) for r in "abc"])
    print(f"max |logits - transformers| = {worst:.2e}")
    assert worst < 1e-4
    result = runner.execute([decode(r) for r in "abc"])  # greedy, sampled on the device
    for r in "abc":
        assert result.sampled[r] == int(hf_logits(seqs[r])[-1].argmax())


def test_padding_a_decode_batch_changes_no_real_row_and_writes_no_kv(
        weights: dict[str, torch.Tensor]) -> None:
    cfg = tiny_config()
    model = CudaLlama(cfg, dict(weights), DEVICE, torch.float32)
    pool = torch.randn((12, cfg.num_layers, 2, BS, cfg.num_kv_heads, cfg.head_dim),
                       device=DEVICE)
    runner = CudaModelRunner(model, pool, BS, max_batch=8, max_model_len=32)
    batch = build_batch([chunk("x", [3], 6, [4, 8]), chunk("y", [17], 9, [1, 2, 10])], BS)
    plan = runner.plan
    assert plan.bucket_for(batch.num_seqs) == 2 and plan.fits(batch)
    three = build_batch([chunk(r, [5], 2, [i]) for i, r in enumerate("pqr")], BS)
    padded = plan.padded(three)
    assert padded.num_seqs == 4 and padded.width == plan.width == 8  # 32 tokens / 4
    assert padded.slots.tolist()[3] == -1 and padded.block_tables[:3, 0].tolist() == [0, 1, 2]
    before = pool.clone()
    plain = runner.forward(three)
    after_plain = pool.clone()
    pool.copy_(before)
    padded_logits = runner.forward(padded)
    # Equal up to the GEMM's rounding at another batch size (M = 4 rather than 3).
    assert (padded_logits[:3] - plain).abs().max().item() < 1e-5
    assert torch.allclose(pool, after_plain, atol=1e-5)
    changed = (pool != before).permute(0, 3, 1, 2, 4, 5).flatten(2).any(-1).nonzero().tolist()
    assert sorted(map(tuple, changed)) == [(0, 2), (1, 2), (2, 2)]  # the padding wrote nothing


def test_graph_plan_buckets() -> None:
    plan = GraphPlan.make(max_batch=100, max_model_len=8192, block_size=16)
    assert plan.buckets[-1] == 100 and 128 not in plan.buckets and plan.width == 512
    assert [plan.bucket_for(n) for n in (1, 3, 17, 33, 97, 100, 101)] == [1, 4, 24, 48, 100,
                                                                           100, None]
    prefill = build_batch([chunk("a", [1, 2], 0, [0])], 16)
    assert not plan.fits(prefill)
    assert plan.fits(build_batch([chunk("a", [1], 5, [0])], 16))
    with pytest.raises(ValueError):
        GraphPlan.make(max_batch=0, max_model_len=16, block_size=16)


def test_position_past_the_context_is_refused(weights: dict[str, torch.Tensor]) -> None:
    cfg = tiny_config()
    pool = torch.zeros((40, cfg.num_layers, 2, BS, cfg.num_kv_heads, cfg.head_dim),
                       device=DEVICE)
    runner = CudaModelRunner(CudaLlama(cfg, dict(weights), DEVICE, torch.float32), pool, BS)
    with pytest.raises(ValueError, match="past the model's context"):
        runner.logits([chunk("a", [1], cfg.max_position, list(range(cfg.max_position // BS + 1)))])


@pytest.mark.gpu
def test_cuda_graph_replay_equals_the_eager_forward(weights: dict[str, torch.Tensor]) -> None:
    """Decode batches of several sizes through the captured graphs (padded to their bucket,
    tables widened) give the eager forward's logits and write the same KV."""
    cfg = tiny_config()
    model = CudaLlama(cfg, dict(weights), DEVICE, torch.float32)
    pool = torch.randn((64, cfg.num_layers, 2, BS, cfg.num_kv_heads, cfg.head_dim),
                       device=DEVICE)
    graphed = CudaModelRunner(model, pool, BS, max_batch=8, max_model_len=48)
    eager = CudaModelRunner(model, pool, BS, max_batch=8, max_model_len=48, graphs=False)
    assert graphed.graphs is not None and eager.graphs is None
    for n in (1, 3, 8):
        step = [chunk(f"r{i}", [5 + i], 3 + 4 * i, list(range(8 * i, 8 * i + i + 2)))
                for i in range(n)]  # disjoint tables: no two rows write one slot
        before = pool.clone()
        want = eager.logits(step)
        after = pool.clone()
        pool.copy_(before)
        got = graphed.logits(step)
        assert (got - want).abs().max().item() < 1e-4
        assert torch.allclose(pool, after, atol=1e-5)
    assert graphed.graph_steps == 3 and graphed.eager_steps == 0


def test_runner_gives_logprobs_echo_penalties_and_bias_as_the_cpu_path(
        weights: dict[str, torch.Tensor], hf_logits) -> None:  # type: ignore[no-untyped-def]
    """What the OpenAI surface asks of a worker beyond plain sampling, on the CUDA runner:
    the sampled token's logprobs with the top k, echo's prompt logprobs, and penalties and
    logit bias through the per-request sampling state, equal to the CPU path's math
    (worker/logits_processing.py) over transformers' logits."""
    from common.contracts import SamplingState
    from worker.logits_processing import process
    from worker.sampling_state import SamplingStates

    cfg = tiny_config()
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, cfg.vocab_size, 9).tolist(), rng.integers(0, cfg.vocab_size, 6).tolist()
    pool = torch.zeros((8, cfg.num_layers, 2, BS, cfg.num_kv_heads, cfg.head_dim), device=DEVICE)
    runner = CudaModelRunner(CudaLlama(cfg, dict(weights), DEVICE, torch.float32), pool, BS,
                             max_batch=4)
    ref_a, ref_b = torch.log_softmax(hf_logits(a), -1), hf_logits(b)[-1]
    banned = int(ref_b.argmax())
    forced = int(ref_b.argmin())  # the least likely token, made certain by the bias
    state = SamplingState(logit_bias={forced: 100.0, banned: -100.0}, prompt_token_ids=b)
    ca = ScheduledChunk("a", a, 0, [3, 1, 6], True, temperature=0.0, logprobs=2,
                        prompt_logprob_targets=a[1:])
    cb = ScheduledChunk("b", b, 0, [5, 0], True, temperature=0.0, repetition_penalty=1.3,
                        stateful=True, state=state)
    res = runner.execute([ca, cb])

    # a: greedy, its logprob and top 2 are the reference's; echo scores a[1:] in order
    lp = res.logprobs["a"]
    assert lp.token_id == res.sampled["a"] == int(ref_a[-1].argmax())
    assert abs(lp.logprob - ref_a[-1, lp.token_id].item()) < 1e-4
    assert lp.top_ids == torch.topk(ref_a[-1], 2).indices.tolist()
    echo = res.prompt_logprobs["a"]
    assert [e.token_id for e in echo] == a[1:]
    worst = max(abs(e.logprob - ref_a[i, a[i + 1]].item()) for i, e in enumerate(echo))
    assert worst < 1e-4, worst
    assert "b" not in res.logprobs and "b" not in res.prompt_logprobs

    # b: bias and repetition penalty as the CPU path applies them to the same logits
    assert res.sampled["b"] == forced
    params = SamplingStates(cfg.vocab_size).params([cb])
    assert res.sampled["b"] == int(process(ref_b[None], params)[0].argmax())
    # The state is kept: the next decode of b needs no state sent, and release drops it.
    nxt = ScheduledChunk("b", [forced], len(b), [5, 0], True, temperature=0.0,
                         output_index=1, repetition_penalty=1.3, stateful=True)
    assert runner.execute([nxt]).sampled["b"] == forced
    runner.release(["b"])
    assert "b" not in runner.sampling
