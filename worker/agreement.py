"""Greedy agreement with float32: the answers a user would see, not a perplexity.

`agreement` asks every question of worker/data/agreement_questions.txt (one user message in
the chat template each) and compares a format's greedy answer, up to `ANSWER_TOKENS` tokens
or the end of the turn, with float32's. `python -m worker.agreement` prints the count and
every answer that differs (docs/results/executor/README.md); tests/test_default_format.py
holds the default format to a bound on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from common.tokenizer import Tokenizer
from worker.model import LlamaModel
from worker.quality import greedy

QUESTIONS_PATH = Path(__file__).resolve().parent / "data" / "agreement_questions.txt"
ANSWER_TOKENS = 32


def questions(path: Path = QUESTIONS_PATH) -> list[str]:
    """The agreement questions: one user message per line, '#' lines are comments."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [q.strip() for q in lines if q.strip() and not q.lstrip().startswith("#")]


def _answer(ids: list[int], eos: Sequence[int]) -> list[int]:
    """The answer a user sees: up to and including the first end-of-turn token."""
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids


@dataclass(slots=True)
class Agreement:
    """A format's greedy answers beside the reference format's, per question."""

    questions: list[str]
    answers: list[list[int]]
    reference: list[list[int]]

    @property
    def same(self) -> int:
        return sum(a == b for a, b in zip(self.answers, self.reference))

    def differing(self) -> list[int]:
        return [i for i, (a, b) in enumerate(zip(self.answers, self.reference)) if a != b]


def agreement(model: LlamaModel, weights: str, kv_dtype: torch.dtype, prompts: list[list[int]],
              reference: list[list[int]] | None = None, ref_weights: str = "float32",
              ref_kv_dtype: torch.dtype = torch.float32, eos: Sequence[int] = (),
              new: int = ANSWER_TOKENS, texts: list[str] | None = None) -> Agreement:
    """Greedy answers of `weights` to every prompt (token ids, chat template applied)
    against `reference` (or, when None, `ref_weights`' answers computed here). Answers
    end at the first `eos` token."""
    ref = reference if reference is not None else [
        _answer(a, eos) for a in greedy(model, ref_weights, ref_kv_dtype, prompts, new)]
    got = [_answer(a, eos) for a in greedy(model, weights, kv_dtype, prompts, new)]
    return Agreement(texts if texts is not None else [""] * len(prompts), got, ref)


def chat_prompts(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text as one user message in the model's chat template, as token ids."""
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]


def main(argv: list[str] | None = None) -> int:
    """``python -m worker.agreement``: the default format's (or --format's) greedy answers to
    the shipped questions against float32's; prints the count and every answer that differs."""
    import argparse
    import json
    import time

    from common.modelfile import resolve_model
    from worker import kernels
    from worker.build import add_format, load_model
    from worker.formats import FORMATS, Capabilities, candidates, kv_dtype, qgemm_isa

    p = argparse.ArgumentParser(prog="python -m worker.agreement", description=main.__doc__)
    p.add_argument("--model", default=None, help="a .gguf file or HF directory (default: bundled)")
    p.add_argument("--format", default="auto",
                   help="a --dtype name (default: the one `auto` takes first on this machine)")
    p.add_argument("--kv-dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    p.add_argument("--new-tokens", type=int, default=ANSWER_TOKENS)
    p.add_argument("--json", default=None, help="write the answers and counts here")
    args = p.parse_args(argv)
    source = resolve_model(args.model)
    ops = kernels.load()
    caps = Capabilities.detect(ops, source.kind)
    fmt = candidates(args.format, caps)[0]
    lm = load_model(source, ops)
    tok = Tokenizer.from_source(source)
    texts = questions()
    prompts = chat_prompts(tok, texts)
    t0 = time.perf_counter()
    add_format(lm, FORMATS["float32"], caps)
    add_format(lm, fmt, caps)
    ag = agreement(lm, fmt.name, kv_dtype(fmt, args.kv_dtype), prompts, eos=tok.eos_token_ids,
                   new=args.new_tokens, texts=texts)
    print(f"{fmt.name} (qgemm {qgemm_isa(ops)}, KV {kv_dtype(fmt, args.kv_dtype)}) vs float32: "
          f"{ag.same} of {len(texts)} greedy answers identical ({args.new_tokens} tokens, chat "
          f"template; {time.perf_counter() - t0:.0f} s)")
    for i in ag.differing():
        print(f"  differs: {texts[i]!r}\n    float32: {tok.decode(ag.reference[i])!r}\n"
              f"    {fmt.name}: {tok.decode(ag.answers[i])!r}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "format": fmt.name, "qgemm": qgemm_isa(ops), "kv_dtype": str(kv_dtype(fmt, args.kv_dtype)),
            "same": ag.same, "questions": len(texts), "new_tokens": args.new_tokens,
            "differing": [texts[i] for i in ag.differing()],
            "answers": [tok.decode(a) for a in ag.answers],
            "reference": [tok.decode(a) for a in ag.reference]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
