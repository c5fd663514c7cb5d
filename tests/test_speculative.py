"""Speculative decoding, part 1 (scheduler_svc/speculative.py): prompt lookup, drafts
verified in the batched step, rejected slots rolled back before anything (a prefix name,
an eager copy, a rotation) can take them.

Scheduler-level runs use the token-level KV checker (tests/kvcheck.py) with a model that
copies from its context, so that prompt lookup proposes drafts that are mostly right and
sometimes wrong; model-level runs use the bundled model in float32, where speculation must
not change a single greedy token.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.config import EngineConfig
from common.speculative import SpeculativeConfig, SpeculativeConfigError
from scheduler_svc.policy import RotationLimits
from scheduler_svc.request import Request, SamplingParams
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.speculative import NgramIndex, Speculator
from tests.kvcheck import next_token
from tests.test_pipeline import _check, _serve

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)
PROMPTS = Path(__file__).parents[1] / "superinfer/bench/serve/data/spec_prompts.jsonl"


def copying(ctx: list[int]) -> int:
    """Repeats the token five back, but at every seventh position, where it hashes: prompt
    lookup's drafts are right for a while, then wrong."""
    n = len(ctx)
    return next_token(ctx) if n < 5 or n % 7 == 0 else ctx[n - 5]


# -- the proposer ------------------------------------------------------------------------------


def test_prompt_lookup_proposes_what_followed_the_latest_earlier_match() -> None:
    ix = NgramIndex(1, 3)

    def match(seq: list[int]) -> int | None:
        return ix.match(lambda a, b: seq[a:b], len(seq))

    seq = [1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3]
    at = match(seq)
    assert at is not None and seq[at:at + 2] == [8, 5]  # the latest [1, 2, 3] came before 8
    assert match([4, 5, 6]) is None  # nothing before: the suffix never finds itself
    seq += [8]
    at = match(seq)  # [1, 2, 3, 8] extends the index incrementally
    assert at is not None and seq[at] == 5


def _req(prompt: list[int], **sampling: object) -> Request:
    return Request("r", prompt, SamplingParams(max_tokens=50, **sampling), 0.0)  # type: ignore[arg-type]


def test_only_greedy_stateless_requests_that_allow_it_speculate() -> None:
    spec = Speculator(SPEC)

    def drafts(req: Request, limit: int = 8) -> list[int]:
        spec.begin([req])  # no step times measured yet: every proposal is verified
        return spec.drafts(req, limit)

    prompt = [1, 2, 3, 4, 1, 2, 3]
    assert drafts(_req(prompt, temperature=0.0)) == [4, 1, 2, 3]
    assert drafts(_req(prompt, temperature=0.0), 2) == [4, 1]  # the budget left
    assert drafts(_req(prompt, temperature=0.7)) == []
    assert drafts(_req(prompt, temperature=0.0, presence_penalty=0.5)) == []
    assert drafts(_req(prompt, temperature=0.0, logit_bias={5: 1.0})) == []
    off = _req(prompt, temperature=0.0)
    off.speculative = False
    assert drafts(off) == []
    near_end = _req(prompt, temperature=0.0)
    near_end.sampling.max_tokens = 2  # one token after this step's first: one draft
    assert drafts(near_end) == [4]


def test_a_batch_verifies_the_drafts_that_pay_for_their_rows() -> None:
    """Step times in stairs (a block of 4 rows, 4 ms each): the drafts kept are those
    that maximise expected tokens per second — free rows first, a new block only when
    its drafts fill it with enough expected tokens."""
    spec = Speculator(SPEC)
    for rows in range(1, 17):
        for _ in range(3):
            spec.observe(rows, 0.004 * (1 + (rows - 1) // 4))
    copying = _req([1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2], temperature=0.0)
    spec.begin([copying])
    assert len(spec.drafts(copying, 8)) == 3  # 1 + 3 rows: one block, the drafts free
    reqs = [_req([1, 2, 3, 1, 2], temperature=0.0) for _ in range(4)]
    for i, r in enumerate(reqs):
        r.request_id = f"f{i}"
    # Two decodes: one draft each fills their block (free); two each would open the next
    # (at the prior rate 0.7: 4.4 expected tokens in 8 ms, less than 3.4 in 4 ms).
    spec.begin(reqs[:2])
    assert [len(spec.drafts(r, 8)) for r in reqs[:2]] == [1, 1]
    # Four decodes fill a block: any draft opens the next one, and doubles the step for
    # fewer than four expected tokens.
    spec.begin(reqs)
    assert [spec.drafts(r, 8) for r in reqs] == [[], [], [], []]


def test_proposals_not_verified_are_scored_as_the_tokens_land() -> None:
    """A request not given its drafts (its last token in flight, or rows that do not pay)
    still learns its rate: what prompt lookup predicted is checked against the tokens as
    they land, for free."""
    spec = Speculator(SPEC)
    miss = _req([1, 2, 3, 1, 2], temperature=0.0)
    hit = _req([5, 6, 7, 5, 6], temperature=0.0)
    hit.request_id = "s"
    for r in (miss, hit):
        r.num_placeholders = 1  # its last token is being sampled
    spec.begin([miss, hit])
    prior = spec.rate("r")
    spec.landed("r", [9])  # it predicted 3
    for tok in (7, 5, 6):  # it predicted 7, 5, 6
        spec.landed("s", [tok])
    assert spec.rate("r") < prior < spec.rate("s")
    assert spec.stats.num_draft_tokens == 0  # nothing was verified


@pytest.mark.parametrize("text, why", [
    ('{"method": "eagle"}', "not supported yet"),
    ('{"method": "medusa-ish"}', "unknown speculative method"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup"),
    ('{"method": "ngram", "draft_tensor_parallel_size": 1}', "unknown key"),
    ("ngram", "JSON object"),
])
def test_a_bad_speculative_config_says_what_to_change(text: str, why: str) -> None:
    with pytest.raises(SpeculativeConfigError, match=why):
        SpeculativeConfig.parse(text)


def test_speculative_config_reads_vllms_shape_and_round_trips() -> None:
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, '
                                  '"prompt_lookup_max": 5}')
    assert cfg == SpeculativeConfig("ngram", 3, 5, 2)
    assert SpeculativeConfig.parse(str(cfg)) == cfg  # serve passes it on as text
    assert SpeculativeConfig.parse("none") is None


def test_serve_refuses_a_bad_speculative_config_before_starting_anything(capsys) -> None:  # noqa: ANN001
    from superinfer.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--speculative-config", '{"method": "eagle3"}'])
    assert e.value.code == 2
    assert "not supported yet" in capsys.readouterr().err


# -- the scheduler, against the token-level KV checker -------------------------------------------


def _workload(n: int) -> tuple[list[list[int]], list[int]]:
    prompts = [[7 * i + j for j in range(6 + i % 4)] for i in range(n)]
    return prompts, [20 + 3 * (i % 5) for i in range(n)]


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "serial"])
@pytest.mark.parametrize("policy", ["lvf", "fcfs"])
@pytest.mark.parametrize("caching", [False, True], ids=["", "prefix-caching"])
def test_speculation_is_exact_and_rolls_back_under_rotation(pipeline: bool, policy: str,
                                                            caching: bool) -> None:
    """A device pool a quarter of the working set: requests rotate while they speculate;
    every step checks integrity and that no synced, named or copied block holds a
    rejected draft (tests/kvcheck.py)."""
    prompts, lens = _workload(12)
    got, sched = _serve(policy, prompts, lens, device_blocks=24, aborts={}, pipeline=pipeline,
                        caching=caching, speculative=SPEC, model=copying,
                        limits=RotationLimits.bare(min_residency=2))
    _check(got, sched, prompts, lens, set(), 24, copying)
    st_ = _spec_stats(sched)
    assert st_.num_drafts > 0 and 0 < st_.num_accepted_tokens < st_.num_draft_tokens
    if policy != "fcfs":
        assert sched.stats.rotations > 0


def _spec_stats(sched: Scheduler):  # noqa: ANN202
    assert sched.speculator is not None
    return sched.speculator.stats


def test_the_checker_catches_a_rejected_draft_kept_as_kv(monkeypatch) -> None:  # noqa: ANN001
    """The rollback is what keeps rejected drafts out: without it, the run fails."""
    monkeypatch.setattr(Scheduler, "_roll_back", lambda self, req, valid: None)
    prompts, lens = _workload(4)
    with pytest.raises(AssertionError):
        _serve("lvf", prompts, lens, device_blocks=64, aborts={}, speculative=SPEC,
               model=copying, caching=True)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    n=st.integers(2, 8),
    device_blocks=st.integers(10, 24),
    pipeline=st.booleans(),
    caching=st.booleans(),
)
def test_random_speculative_workloads_stay_exact(data, n, device_blocks, pipeline, caching):  # noqa: ANN001
    period = data.draw(st.integers(2, 6))
    prompts = [data.draw(st.lists(st.integers(0, 30), min_size=period, max_size=14))
               for _ in range(n)]
    lens = [data.draw(st.integers(1, 30)) for _ in range(n)]
    aborted = set(data.draw(st.lists(st.integers(0, n - 1), max_size=2, unique=True)))
    aborts = {i: data.draw(st.integers(1, 40)) for i in aborted}

    def model(ctx: list[int]) -> int:
        k = len(ctx)
        return next_token(ctx) % 31 if k % 5 == 0 else ctx[k - period]

    k = data.draw(st.integers(1, 6))
    spec = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_max=3, prompt_lookup_min=1)
    got, sched = _serve("lvf", prompts, lens, device_blocks, aborts, pipeline=pipeline,
                        caching=caching, speculative=spec, model=model,
                        limits=RotationLimits.bare(min_residency=2))
    _check(got, sched, prompts, lens, aborted, device_blocks, model)


# -- the bundled model, float32 ----------------------------------------------------------------


@pytest.fixture(scope="module")
def engines():  # noqa: ANN201
    from superinfer.engine import LLMEngine

    off = LLMEngine(EngineConfig(device_blocks=512, host_blocks=0, dtype="float32"))
    on = LLMEngine(EngineConfig(device_blocks=512, host_blocks=0, dtype="float32",
                                speculative_config=SpeculativeConfig()), reuse=off)
    return off, on


def _prompts(engine, kinds: tuple[str, ...], per_kind: int) -> list[list[int]]:  # noqa: ANN001
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    tok = engine.tokenizer
    out = []
    for kind in kinds:
        for r in [r for r in rows if r["kind"] == kind][:per_kind]:
            out.append(tok.encode(tok.apply_chat_template(r["messages"])))
    return out


@pytest.mark.slow
def test_greedy_text_is_identical_with_speculation_on_and_off(engines) -> None:  # noqa: ANN001
    off, on = engines
    prompts = _prompts(off, ("rewrite", "code-edit", "extract", "multi-turn"), 1)
    sp = SamplingParams(max_tokens=40, temperature=0.0)
    want = [r.token_ids for r in off.generate(prompts, sp)]
    got = on.generate(prompts, sp)
    assert [r.token_ids for r in got] == want
    st_ = on.scheduler.speculator.stats
    assert st_.num_accepted_tokens > 0  # it did speculate, and kept drafts


@pytest.mark.slow
def test_rotation_pressure_with_speculation_keeps_every_greedy_stream_exact(engines) -> None:  # noqa: ANN001
    """A device pool a quarter of the working set, prefix caching on, integrity checked
    after every step."""
    from superinfer.engine import LLMEngine

    off, _ = engines
    prompts = _prompts(off, ("rewrite", "code-edit", "extract", "multi-turn"), 1)
    sp = SamplingParams(max_tokens=32, temperature=0.0)
    want = [r.token_ids for r in off.generate(prompts, sp)]
    working = sum(-(-(len(p) + 32) // 16) for p in prompts)
    tight = LLMEngine(EngineConfig(device_blocks=max(working // 4, 40), host_blocks=512,
                                   dtype="float32", enable_prefix_caching=True,
                                   speculative_config=SpeculativeConfig()), reuse=off)
    ids = [tight.add_request(p, sp) for p in prompts]
    got = tight.run_to_completion(ids, after_step=tight.scheduler.check_integrity)
    assert [r.token_ids for r in got] == want
    assert tight.scheduler.stats.rotations + tight.scheduler.stats.recomputes > 0
    assert tight.scheduler.speculator.stats.num_accepted_tokens > 0


@pytest.mark.slow
def test_stop_strings_max_tokens_and_logprobs_see_accepted_tokens_only(engines) -> None:  # noqa: ANN001
    off, on = engines
    (prompt,) = _prompts(off, ("rewrite",), 1)
    free = off.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0))[0]
    # A stop string from the middle of the text: it ends inside an accepted run or not,
    # the output ends where it does without speculation.
    words = free.text.split()
    stop = " ".join(words[len(words) // 2: len(words) // 2 + 2])
    for sp in (SamplingParams(max_tokens=40, temperature=0.0, stop=(stop,)),
               SamplingParams(max_tokens=13, temperature=0.0),
               SamplingParams(max_tokens=24, temperature=0.0, logprobs=2)):
        a = off.generate([prompt], sp)[0]
        b = on.generate([prompt], sp)[0]
        assert (b.text, b.token_ids, b.finish_reason) == (a.text, a.token_ids, a.finish_reason)
        if sp.logprobs is not None:
            assert len(b.logprobs) == len(b.token_ids) == len(a.logprobs)
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert x.token_id == y.token_id and x.top_ids == y.top_ids
                assert abs(x.logprob - y.logprob) < 1e-3


@pytest.mark.slow
def test_greedy_choices_of_one_prompt_speculate_alike(engines) -> None:  # noqa: ANN001
    off, on = engines
    (prompt,) = _prompts(off, ("code-edit",), 1)
    sp = SamplingParams(max_tokens=24, temperature=0.0)
    ids = on.add_choices(prompt, sp, 2)
    a, b = on.run_to_completion(ids)
    want = off.generate([prompt], sp)[0]
    assert a.token_ids == b.token_ids == want.token_ids
