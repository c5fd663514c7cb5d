"""The layer rules of docs/ARCHITECTURE.md: no import cycles, the policy names agree."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from common.config import POLICY_NAMES, EngineConfig
from scheduler_svc.policy import make_policy

ROOT = Path(__file__).resolve().parent.parent


def _cycles_module():
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "scripts/import_cycles.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def test_strongly_connected_finds_cycles_and_only_them():
    sc = _cycles_module().strongly_connected
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": {"g"}, "g": {"f"}}
    groups = sc(sorted("abcdefg"), edges)
    assert sorted(groups) == [["a", "b", "c"], ["f", "g"]]  # d only points in; e's self-loop is no cycle


def test_the_tree_has_no_import_cycle(capsys):
    assert _cycles_module().main() == 0
    assert capsys.readouterr().out.strip() == "0"


def test_scheduler_core_does_not_load_torch():
    code = ("import sys; import scheduler_svc.scheduler, scheduler_svc.service, scheduler_svc.loop, "
            "gateway.app; print('torch' in sys.modules)")
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_name_builds_its_policy(name):
    assert make_policy(name).name == name
    assert EngineConfig(policy=name).policy == name


def test_unknown_policy_is_refused_by_the_config_and_the_registry():
    with pytest.raises(ValueError, match="unknown policy"):
        EngineConfig(policy="round-robin")
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("round-robin")
