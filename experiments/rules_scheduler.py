"""`python -m experiments.rules_scheduler`: the scheduler service with LVF's rules overridden.

LVF's rules (`RotationLimits`, scheduler_svc/policy/base.py: `min_residency`,
`adapt_residency`, `memory_margin`, ...) have no server flag, environment variable or
config file on purpose; an experiment that runs the real stack with other values sets them
here, in the experiment's own process, and nowhere else:

    python -m experiments.rules_scheduler --rules adapt_residency=off,min_residency=0 \\
        <the argv of `superinfer scheduler`>

runs the scheduler service exactly as `superinfer scheduler <argv>` would (the same
`superinfer.cli.main`, so the same parser, logging, supervisor tie and daemon), except that
`scheduler_svc.setup.rotation_limits` is wrapped in this process: the limits it returns
for the engine's configuration get the overrides, so `policy_from` (and so
`build_scheduler`) builds the policy with them. Values: on/off (true/false, yes/no) for a
flag, numbers, `none` for a rule that may be off; each is converted to its field's type
and the result checked by `RotationLimits` itself, so a bad key or value is refused before
anything starts. One key is not a rotation rule: `fairness=shares|vtc|global`, the
scheduler's order across tenants (scheduler_svc/policy/shares.py; `SchedulerConfig.fairness`). `--rules ''` applies none (the same process, the default rules).

With `--serve`, the rest is `superinfer serve`'s argv instead: the whole four-service stack
starts as `superinfer serve` starts it (`services_cli._serve`: the same supervisor, probes,
restarts and staged stop), with only the scheduler child's command changed from
`python -m superinfer.cli scheduler …` to `python -m experiments.rules_scheduler --rules
RULES …`. The rules travel on that command line only, never as a server flag.

The overrides are logged: as a JSON line on stderr at start (`rules_scheduler starting`,
in the service's `.out` under `serve`), and again as `rotation rules overridden` (or `...:
none overridden`) with every resulting limit when the scheduler builds its policy (in
scheduler.log too).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

USAGE = ("usage: python -m experiments.rules_scheduler --rules KEY=VALUE[,KEY=VALUE...] "
         "[--serve] ARGV...\n"
         "  runs `superinfer scheduler ARGV` (with --serve: `superinfer serve ARGV`, whose "
         "scheduler child\n  runs through this module) with LVF's RotationLimits overridden; "
         "e.g. --rules adapt_residency=off,min_residency=0")

_TRUE = {"on", "true", "yes", "1"}
_FALSE = {"off", "false", "no", "0"}
_NONE = {"none", "null"}


class RulesError(ValueError):
    """A --rules text that names no rule, or a value the rule cannot take."""


def rule_types() -> dict[str, Any]:
    """RotationLimits' fields and their types (the annotations resolved)."""
    from scheduler_svc.policy.base import RotationLimits

    hints = typing.get_type_hints(RotationLimits)
    return {f.name: hints[f.name] for f in dataclasses.fields(RotationLimits)}


def _convert(key: str, text: str, kind: Any) -> object:
    """`text` as a value of type `kind` (bool, int, float, or one of them | None)."""
    low = text.strip().lower()
    args = typing.get_args(kind)
    optional = type(None) in args and (typing.get_origin(kind) in (typing.Union, types.UnionType))
    base = next((a for a in args if a is not type(None)), kind) if optional else kind
    if low in _NONE:
        if optional:
            return None
        raise RulesError(f"rule {key!r} cannot be none (it is a {base.__name__})")
    if base is bool:
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise RulesError(f"rule {key!r} is on or off, got {text!r}")
    try:
        if base is int:
            return int(low)
        if base is float:
            return float(low)
    except ValueError:
        raise RulesError(f"rule {key!r} takes {'an integer' if base is int else 'a number'}"
                         f"{' or none' if optional else ''}, got {text!r}") from None
    raise RulesError(f"rule {key!r} has a type this parser does not know: {kind!r}")


def parse_rules(text: str) -> dict[str, object]:
    """`KEY=VALUE[,KEY=VALUE...]` -> {field: value}, converted and checked: every key a
    RotationLimits field, every value of its type, and RotationLimits built with them
    (its own range checks). '' -> {}."""
    from scheduler_svc.policy.base import RotationLimits
    from scheduler_svc.policy.shares import FAIRNESS

    types_ = rule_types()
    out: dict[str, object] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not value.strip():
            raise RulesError(f"rule {part!r}: expected KEY=VALUE, e.g. min_residency=0")
        if key == FAIRNESS_RULE:  # the scheduler's, not the policy's (policy/shares.py)
            if value.strip() not in FAIRNESS:
                raise RulesError(f"fairness is one of {', '.join(FAIRNESS)}, got {value!r}")
            out[key] = value.strip()
            continue
        if key not in types_:
            raise RulesError(f"unknown rule {key!r}; RotationLimits has: "
                             f"{', '.join(sorted(types_))}")
        if key in out:
            raise RulesError(f"rule {key!r} is given twice")
        out[key] = _convert(key, value, types_[key])
    try:
        dataclasses.replace(RotationLimits(), **limits_of(out))  # type: ignore[arg-type]
    except ValueError as e:
        raise RulesError(f"rules {text!r}: {e}") from None
    return out


def format_rules(rules: dict[str, object]) -> str:
    """The --rules text that parses back to `rules`."""
    def word(v: object) -> str:
        if v is None:
            return "none"
        if isinstance(v, bool):
            return "on" if v else "off"
        return str(v)

    return ",".join(f"{k}={word(v)}" for k, v in rules.items())


FAIRNESS_RULE = "fairness"  # across tenants: SchedulerConfig.fairness, not a RotationLimits field


def limits_of(rules: dict[str, object]) -> dict[str, object]:
    return {k: v for k, v in rules.items() if k != FAIRNESS_RULE}


def _log() -> Any:
    import structlog

    return structlog.get_logger()


def install(rules: dict[str, object]) -> Callable[[], None]:
    """Wrap `scheduler_svc.setup.rotation_limits` in this process so that the limits it
    returns get `rules`; returns the function that undoes it. `policy_from` looks the
    function up in its module at every call, so every policy built here after this has
    them."""
    from scheduler_svc import setup

    original = setup.rotation_limits
    if getattr(original, "__rules__", None) is not None:
        raise RuntimeError("rotation rules are already overridden in this process")

    limit_rules = limits_of(rules)
    fairness = str(rules[FAIRNESS_RULE]) if FAIRNESS_RULE in rules else None
    original_config = setup.scheduler_config

    def scheduler_config(*args: Any, **kwargs: Any) -> Any:
        config = original_config(*args, **kwargs)
        _log().info("fairness overridden", fairness=fairness)
        return dataclasses.replace(config, fairness=fairness or config.fairness)

    def rotation_limits(cfg: Any) -> Any:
        limits = dataclasses.replace(original(cfg), **limit_rules)  # type: ignore[arg-type]
        # vLLM's baselines take only these two of the limits (policy/__init__.py).
        ignored = (cfg.policy not in ("lvf", "waiting-first")
                   and set(rules) - {"iteration_budget", "prefill_within"})
        _log().info("rotation rules overridden" if rules else "rotation rules: none overridden",
                    overrides=dict(rules), policy=cfg.policy, limits=dataclasses.asdict(limits),
                    **({"ignored_by_policy": sorted(ignored)} if ignored else {}))
        return limits

    rotation_limits.__rules__ = dict(rules)  # type: ignore[attr-defined]
    rotation_limits.__wrapped__ = original  # type: ignore[attr-defined]
    setup.rotation_limits = rotation_limits
    if fairness is not None:
        setup.scheduler_config = scheduler_config

    def undo() -> None:
        setup.rotation_limits = original
        setup.scheduler_config = original_config

    return undo


def scheduler_command(rules_text: str, argv: Sequence[str]) -> list[str]:
    """The command that runs the scheduler service with `argv` through this module."""
    return [sys.executable, "-m", "experiments.rules_scheduler", "--rules", rules_text, *argv]


def swap_scheduler(specs: list[Any], rules_text: str) -> list[Any]:
    """`service_specs`' children with the scheduler's `python -m superinfer.cli scheduler`
    replaced by this module's command (its flags, probe and pid file unchanged)."""
    out = []
    found = False
    for spec in specs:
        if spec.name == "scheduler":
            argv = list(spec.argv)
            head = [sys.executable, "-m", "superinfer.cli", "scheduler"]
            if argv[:4] != head:
                raise RuntimeError(f"the scheduler's command does not start with {head}: "
                                   f"{argv[:4]} (services_cli.service_specs changed?)")
            spec = dataclasses.replace(spec, argv=scheduler_command(rules_text, argv[4:]))
            found = True
        out.append(spec)
    if not found:
        raise RuntimeError("service_specs has no scheduler")
    return out


def _repo_on_path() -> None:
    """Children run `python -m experiments.rules_scheduler`: make the checkout importable
    from wherever they start (they inherit this environment)."""
    root = str(Path(__file__).resolve().parent.parent)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *parts])


def split_argv(argv: Sequence[str]) -> tuple[str | None, bool, list[str]]:
    """Leading `--rules TEXT` / `--rules=TEXT` and `--serve`; the rest passes through."""
    rules: str | None = None
    serve = False
    rest = list(argv)
    while rest:
        head = rest[0]
        if head == "--rules" and len(rest) > 1:
            rules, rest = rest[1], rest[2:]
        elif head.startswith("--rules="):
            rules, rest = head.split("=", 1)[1], rest[1:]
        elif head == "--serve":
            serve, rest = True, rest[1:]
        else:
            break
    return rules, serve, rest


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE + "\n\n" + (__doc__ or ""))
        return 0
    text, serve, rest = split_argv(argv)
    if text is None:
        print(USAGE + "\nerror: --rules is required (give --rules '' for none)", file=sys.stderr)
        return 2
    try:
        rules = parse_rules(text)
    except RulesError as e:
        print(f"python -m experiments.rules_scheduler: error: {e}", file=sys.stderr)
        return 2
    from common.logging import configure_logging

    configure_logging("supervisor" if serve else "scheduler", level="info")
    canonical = format_rules(rules)
    _log().info("rules_scheduler starting", mode="serve" if serve else "scheduler",
                overrides=rules, rules=canonical or "(none)")
    from superinfer import cli

    if serve:
        from superinfer import services_cli

        _repo_on_path()
        original = services_cli.service_specs

        def service_specs(args: Any) -> list[Any]:
            return swap_scheduler(original(args), canonical)

        services_cli.service_specs = service_specs
        return cli.main(["serve", *rest])
    install(rules)
    return cli.main(["scheduler", *rest])


if __name__ == "__main__":
    sys.exit(main())
