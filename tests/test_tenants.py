"""Tenants: the file, the gateway's gate (keys, limits, defaults) and its reload.

What an operator and a tenant notice, without a stack: a bad file is refused with the
line that is wrong; a key resolves to its tenant; the limits answer 429 with Retry-After
and OpenAI's x-ratelimit-* headers, and free up as time passes; a request takes its
tenant's SLOs and priority bound; a reload of a bad file changes nothing. The stack tests
(tests/test_tenants_stack.py) check the same through real processes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from common.tenants import TenantsError, hash_key, load, new_key, parse
from gateway.context import GatewaySettings
from gateway.conversion import InternalRequest
from gateway.errors import APIError
from gateway.tenants import TenantGate, duration
from proto import common_pb2
from superinfer.services_cli import check_tenants

KEY_A, KEY_B = new_key(), new_key()
GOOD = f"""\
# two tenants
[tenants.alpha]
keys = ["{hash_key(KEY_A)}"]
priority = 2
ttft_slo = 1.5
max_in_flight = 2
tokens_per_minute = 600

[tenants.beta]
keys = ["{hash_key(KEY_B)}"]
weight = 3
"""


class Clock:
    """Time that moves only when the test says."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _bearer(key: str) -> bytes:
    return f"Bearer {key}".encode()


def _request(prompt: int, priority: int = 0, ttft: float = 0.0, tbt: float = 0.0) -> InternalRequest:
    return InternalRequest(prompt_ids=list(range(prompt)), sampling=common_pb2.SamplingParams(),
                           slo=common_pb2.SLO(ttft_s=ttft, tbt_s=tbt), priority=priority)


# -- the file -------------------------------------------------------------------------------


def test_a_good_file_names_each_tenant_by_its_key() -> None:
    t = parse(GOOD)
    assert t.names == ["alpha", "beta"]
    assert t.for_key(KEY_A).name == "alpha" and t.for_key(KEY_B).name == "beta"
    assert t.for_key("sk-si-not-a-key") is None
    a, b = t.by_name["alpha"], t.by_name["beta"]
    assert (a.priority, a.ttft_slo_s, a.tbt_slo_s, a.max_in_flight, a.tokens_per_minute) == (
        2, 1.5, None, 2, 600)
    assert (b.weight, b.priority, b.limited) == (3.0, 0, False)
    assert KEY_A not in GOOD  # the file holds hashes only


@pytest.mark.parametrize(("edit", "line", "words"), [
    (("weight = 3", "weight = -1"), 11, "tenants.beta.weight must be > 0"),
    (("max_in_flight = 2", "max_in_flight = 0"), 6, "max_in_flight must be >= 1"),
    (("priority = 2", "priority = \"high\""), 4, "priority must be an integer"),
    (("ttft_slo = 1.5", "ttft_slo = 1.5\nttft = 2"), 6, "has no field 'ttft'"),
    (("weight = 3", "weight = 3\nkeys = 1"), 12, "not valid TOML"),  # a key given twice
    (("tokens_per_minute = 600", "tokens_per_minute = 600 600"), 7, "not valid TOML"),
    (("[tenants.beta]", "[tenants.\"b c\"]"), 9, "tenant name 'b c' must be"),
])
def test_a_bad_file_is_refused_with_the_line_that_is_wrong(edit: tuple[str, str], line: int,
                                                            words: str) -> None:
    text = GOOD.replace(*edit)
    assert text != GOOD
    with pytest.raises(TenantsError) as err:
        parse(text, "t.toml")
    assert str(err.value).startswith(f"t.toml:{line}: "), str(err.value)
    assert words in str(err.value)


def test_keys_must_be_hashes_and_belong_to_one_tenant() -> None:
    plain = GOOD.replace(f'"{hash_key(KEY_B)}"', f'"{KEY_B}"')
    with pytest.raises(TenantsError, match=r"t.toml:10: .*plain key: store its hash") as err:
        parse(plain, "t.toml")
    assert KEY_B not in str(err.value)  # never echo a secret into a log
    shared = GOOD.replace(hash_key(KEY_B), hash_key(KEY_A))
    with pytest.raises(TenantsError, match="also tenant 'alpha'"):
        parse(shared, "t.toml")
    with pytest.raises(TenantsError, match="has no keys"):
        parse("[tenants.x]\nweight = 1\n")
    with pytest.raises(TenantsError, match="no tenants"):
        parse("")
    with pytest.raises(TenantsError, match="only \\[tenants.NAME\\] tables"):
        parse(GOOD + "\n[limits]\nx = 1\n")


def test_tenants_and_a_single_api_key_do_not_mix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "t.toml"
    f.write_text(GOOD)
    with pytest.raises(ValueError, match="both a tenants file"):
        GatewaySettings(api_key="k", tenants_file=str(f))
    monkeypatch.setenv("SUPERINFER_API_KEY", "k")
    with pytest.raises(ValueError, match="SUPERINFER_API_KEY"):
        check_tenants(str(f))
    monkeypatch.delenv("SUPERINFER_API_KEY")
    check_tenants(str(f))
    f.write_text(GOOD.replace("weight = 3", "weight = 0"))
    with pytest.raises(TenantsError, match=r"t.toml:11:"):
        check_tenants(str(f))


def test_the_cli_makes_a_key_whose_entry_the_file_accepts(tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "superinfer.cli", "tenants"]
    made = subprocess.run([*cli, "new-key", "gamma"], capture_output=True, text=True, check=True)
    key = made.stderr.strip().rsplit(" ", 1)[1]
    f = tmp_path / "t.toml"
    f.write_text(made.stdout)
    assert load(f).for_key(key).name == "gamma"
    hashed = subprocess.run([*cli, "hash-key"], input=key + "\n", capture_output=True,
                            text=True, check=True)
    assert hashed.stdout.strip() == f'"{hash_key(key)}"'
    f.write_text(made.stdout + "priority = 1.5\n")
    bad = subprocess.run([*cli, "check", str(f)], capture_output=True, text=True)
    assert bad.returncode == 1 and f"{f}:3: tenants.gamma.priority must be an integer" in bad.stderr


# -- the gate ---------------------------------------------------------------------------------


def test_an_unknown_or_missing_key_is_a_401() -> None:
    gate = TenantGate(parse(GOOD))
    assert gate.identify(_bearer(KEY_A)).name == "alpha"
    for header in (None, b"", _bearer("sk-si-wrong"), f"Basic {KEY_A}".encode(), b"Bearer "):
        with pytest.raises(APIError) as err:
            gate.identify(header)
        assert err.value.status == 401 and err.value.code == "invalid_api_key"


def test_in_flight_limit_answers_429_until_a_request_ends() -> None:
    gate = TenantGate(parse(GOOD))
    alpha = gate.identify(_bearer(KEY_A))
    gate.enter(alpha)
    gate.enter(alpha)
    assert gate.headers(alpha)["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(APIError) as err:
        gate.enter(alpha)
    e = err.value
    assert e.status == 429 and e.headers["Retry-After"] == "1"
    assert e.headers["x-ratelimit-limit-requests"] == "2"
    assert "max_in_flight" in e.message
    beta = gate.identify(_bearer(KEY_B))
    for _ in range(10):  # beta has no limit, and alpha's does not touch it
        gate.enter(beta)
    assert gate.headers(beta) == {}
    gate.leave(alpha)
    gate.enter(alpha)


def test_token_bucket_refuses_with_the_wait_then_refills() -> None:
    clock = Clock()
    gate = TenantGate(parse(GOOD), clock=clock)
    alpha = gate.identify(_bearer(KEY_A))
    gate.admit(alpha, _request(400))  # 600 per minute: 200 left
    gate.charge(alpha, 150)  # its output: 50 left
    assert gate.headers(alpha)["x-ratelimit-remaining-tokens"] == "50"
    with pytest.raises(APIError) as err:
        gate.admit(alpha, _request(110))
    e = err.value
    # 60 tokens short at 10 tokens a second: 6 s.
    assert e.status == 429 and e.headers["Retry-After"] == "6", e.headers
    assert e.headers["x-ratelimit-limit-tokens"] == "600"
    assert e.headers["x-ratelimit-reset-tokens"] == "55s"  # 550 tokens to refill
    clock.now += 5.9
    with pytest.raises(APIError):
        gate.admit(alpha, _request(110))
    clock.now += 0.2
    gate.admit(alpha, _request(110))
    # Output may take the bucket below zero; then even a small prompt waits.
    gate.charge(alpha, 500)
    with pytest.raises(APIError) as err:
        gate.admit(alpha, _request(1))
    assert int(err.value.headers["Retry-After"]) >= 50
    # A prompt larger than a whole minute passes once the bucket is full, not never.
    clock.now += 3600
    gate.admit(alpha, _request(5000))
    beta = gate.identify(_bearer(KEY_B))
    for _ in range(20):  # no token limit
        gate.admit(beta, _request(5000))


def test_a_request_takes_its_tenants_defaults_and_priority_bound() -> None:
    gate = TenantGate(parse(GOOD))
    alpha, beta = gate.identify(_bearer(KEY_A)), gate.identify(_bearer(KEY_B))
    r = gate.admit(alpha, _request(3, priority=0))
    assert (r.tenant, r.priority, r.slo.ttft_s, r.slo.tbt_s) == ("alpha", 2, 1.5, 0.0)
    r = gate.admit(alpha, _request(3, priority=7, ttft=0.5, tbt=0.05))
    assert (r.priority, r.slo.ttft_s, r.slo.tbt_s) == (7, 0.5, 0.05)  # its own win
    r = gate.admit(beta, _request(3, priority=-4))
    assert (r.tenant, r.priority) == ("beta", 0)
    assert r.scheduler_request("x").tenant == "beta"
    assert r.scheduler_request("x").priority == 0


def test_reload_applies_a_good_file_and_keeps_the_old_one_for_a_bad_one(tmp_path: Path) -> None:
    f = tmp_path / "tenants.toml"
    f.write_text(GOOD)
    gate = TenantGate(load(f))
    alpha = gate.identify(_bearer(KEY_A))
    gate.enter(alpha)
    gate.enter(alpha)  # both of alpha's slots taken across the reloads
    key_c = new_key()
    f.write_text(GOOD.replace("max_in_flight = 2", "max_in_flight = 3")
                 + f'\n[tenants.gamma]\nkeys = ["{hash_key(key_c)}"]\n')
    assert gate.reload()
    assert gate.identify(_bearer(key_c)).name == "gamma"
    gate.enter(alpha)  # the new limit, 3, with the 2 still held counted
    with pytest.raises(APIError):
        gate.enter(alpha)
    before = gate.tenants
    f.write_text(GOOD.replace("weight = 3", "weight = -3"))
    assert not gate.reload()
    assert gate.tenants is before
    assert gate.identify(_bearer(key_c)).name == "gamma"
    f.write_text(GOOD)  # gamma removed: its key is refused from now on
    assert gate.reload()
    with pytest.raises(APIError):
        gate.identify(_bearer(key_c))
    for _ in range(3):
        gate.leave(alpha)
    assert gate.headers(alpha)["x-ratelimit-remaining-requests"] == "2"


def test_reset_times_read_as_openai_writes_them() -> None:
    assert [duration(s) for s in (0.0061, 1.5, 59.0, 150.0)] == ["6ms", "1.5s", "59s", "2m30s"]


def test_the_supervisor_passes_sighup_to_the_gateway(tmp_path: Path) -> None:
    """`serve` hands SIGHUP to its gateway child (which reloads its tenants file)."""
    import signal
    import time

    from superinfer.supervisor import ServiceSpec, Supervisor

    ready, got = tmp_path / "ready", tmp_path / "got"
    child = ("import signal, pathlib, time\n"
             f"signal.signal(signal.SIGHUP, lambda *a: pathlib.Path({str(got)!r}).write_text('hup'))\n"
             f"pathlib.Path({str(ready)!r}).write_text('up')\n"
             "time.sleep(60)\n")
    sup = Supervisor(tmp_path)
    try:
        sup.start(ServiceSpec("gateway", [sys.executable, "-c", child],
                              (ready.exists, lambda: None)), 30)
        assert not sup.send_signal("worker", signal.SIGHUP)  # no such child
        assert sup.send_signal("gateway", signal.SIGHUP)
        deadline = time.monotonic() + 10
        while not got.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert got.read_text() == "hup"
    finally:
        sup.stop_all()
