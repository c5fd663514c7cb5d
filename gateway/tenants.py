"""Tenants at the gateway: who is calling, what they may still use, and their defaults.

`TenantGate` holds the checked tenants file (common/tenants.py) and, per tenant name, what
its requests are using now. Every /v1 request and every client gRPC call passes it:

1. **Identify**: the bearer key's hash names the tenant (401 for a key no tenant holds).
2. **In flight**: a tenant with `max_in_flight` gets a 429 past it, before its body is
   read (Retry-After 1 s: a slot frees when one of its requests ends).
3. **Tokens per minute**: a token bucket of `tokens_per_minute`, refilled continuously.
   A request is admitted once it is tokenized and before anything is queued, when the
   bucket holds its prompt (or is full, for a prompt larger than the whole minute); the
   prompt is taken then and the output tokens when the request ends, so the bucket may
   go below zero and the tenant then waits until it refills. Nothing is reserved for
   `max_tokens` a request may never use. A refused request gets a 429 with Retry-After:
   the seconds until the bucket holds its prompt.
4. **Defaults**: the tenant's TTFT/TBT SLOs fill a request's unset ones, and its priority
   bounds the request's (vLLM's order, lower first: a request may ask for a later class,
   never an earlier one than its tenant's).

Responses to a tenant with limits carry OpenAI's `x-ratelimit-*` headers: `-tokens` for the
token bucket (limit per minute, remaining now, reset = until full) and `-requests` for the
in-flight limit (requests at once, not per minute: SuperInfer limits concurrency).

`reload()` (on SIGHUP) reads the file again; a bad file is refused, logged with its line,
and the old one stays. A reload keeps each tenant's usage (in flight, bucket) by name, so
requests in flight finish under it and release what they took; the new limits apply from
the next request.
"""

from __future__ import annotations

import dataclasses
import hmac
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from common.tenants import Tenant, Tenants, TenantsError, hash_key, load
from gateway.conversion import InternalRequest
from gateway.errors import APIError

log = structlog.get_logger()

IN_FLIGHT_RETRY_S = 1  # a slot frees when one of the tenant's requests ends


@dataclass(slots=True)
class Usage:
    """What one tenant's requests hold now (kept across reloads, by name)."""

    in_flight: int = 0
    tokens: float = math.inf  # the bucket's level (set to the limit on first use)
    updated: float = 0.0


class TenantGate:
    def __init__(self, tenants: Tenants, clock: Callable[[], float] = time.monotonic) -> None:
        self.tenants = tenants
        self._clock = clock
        self._usage: dict[str, Usage] = {}

    @classmethod
    def from_file(cls, path: str) -> TenantGate:
        return cls(load(path))

    # -- who --------------------------------------------------------------------------------
    def identify(self, authorization: bytes | None) -> Tenant:
        """The tenant whose key is the bearer token, or the 401 that says what to send."""
        scheme, _, token = (authorization or b"").partition(b" ")
        tenant = None
        if scheme.lower() == b"bearer" and token.strip():
            h = hash_key(token.strip().decode("utf-8", "replace"))
            tenant = self.tenants.by_hash.get(h)
            # The dictionary found it by the hash; the compare is for form's sake.
            if tenant is not None and not any(hmac.compare_digest(h, k) for k in tenant.key_hashes):
                tenant = None
        if tenant is None:
            raise APIError(401, "missing or unknown API key; send 'Authorization: Bearer <key>' "
                           "with a key of a tenant in the server's tenants file",
                           code="invalid_api_key")
        return tenant

    # -- in flight --------------------------------------------------------------------------
    def enter(self, tenant: Tenant) -> None:
        """Take one of the tenant's in-flight slots, or raise its 429."""
        use = self._use(tenant)
        limit = self._current(tenant).max_in_flight
        if limit is not None and use.in_flight >= limit:
            raise APIError(
                429, f"tenant {tenant.name!r} has {use.in_flight} requests in flight, its "
                f"limit (max_in_flight in the tenants file); retry when one finishes",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(IN_FLIGHT_RETRY_S), **self.headers(tenant)},
            )
        use.in_flight += 1

    def leave(self, tenant: Tenant) -> None:
        self._use(tenant).in_flight -= 1

    # -- tokens -----------------------------------------------------------------------------
    def admit(self, tenant: Tenant, req: InternalRequest) -> InternalRequest:
        """`req` with the tenant's defaults and bound, its prompt taken from the bucket; or
        the 429 that says when to come back."""
        t = self._current(tenant)
        prompt = len(req.prompt_ids)
        if t.tokens_per_minute is not None:
            use = self._refill(t)
            need = min(prompt, t.tokens_per_minute)
            if use.tokens < need:
                wait = math.ceil((need - use.tokens) / (t.tokens_per_minute / 60.0))
                raise APIError(
                    429, f"tenant {t.name!r} is over its limit of {t.tokens_per_minute} tokens "
                    f"per minute (tokens_per_minute in the tenants file): this prompt needs "
                    f"{need}, {max(0, int(use.tokens))} are left; retry in {wait} s",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": str(max(1, wait)), **self.headers(t)},
                )
            use.tokens -= prompt
        slo = req.slo
        if t.ttft_slo_s is not None and not slo.ttft_s:
            slo = type(slo)(ttft_s=t.ttft_slo_s, tbt_s=slo.tbt_s)
        if t.tbt_slo_s is not None and not slo.tbt_s:
            slo = type(slo)(ttft_s=slo.ttft_s, tbt_s=t.tbt_slo_s)
        return dataclasses.replace(req, slo=slo, priority=max(req.priority, t.priority),
                                   tenant=t.name, weight=t.weight)

    def charge(self, tenant: Tenant, tokens: int) -> None:
        """A request of `tenant` ended after generating `tokens`."""
        t = self._current(tenant)
        if t.tokens_per_minute is not None and tokens:
            self._refill(t).tokens -= tokens

    def headers(self, tenant: Tenant) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for the tenant's limits now ({} without limits)."""
        t = self._current(tenant)
        out: dict[str, str] = {}
        if t.max_in_flight is not None:
            use = self._use(t)
            out["x-ratelimit-limit-requests"] = str(t.max_in_flight)
            out["x-ratelimit-remaining-requests"] = str(max(0, t.max_in_flight - use.in_flight))
        if t.tokens_per_minute is not None:
            use = self._refill(t)
            rate = t.tokens_per_minute / 60.0
            out["x-ratelimit-limit-tokens"] = str(t.tokens_per_minute)
            out["x-ratelimit-remaining-tokens"] = str(max(0, int(use.tokens)))
            out["x-ratelimit-reset-tokens"] = duration((t.tokens_per_minute - use.tokens) / rate)
        return out

    # -- reload -----------------------------------------------------------------------------
    def reload(self) -> bool:
        """Read the file again; False (and the old tenants kept) when it is bad."""
        try:
            new = load(self.tenants.path)
        except TenantsError as e:
            log.error("tenants file refused; the previous one stays in force", error=str(e))
            return False
        old = set(self.tenants.by_name)
        self.tenants = new
        for name in list(self._usage):
            if name not in new.by_name and not self._usage[name].in_flight:
                del self._usage[name]
        log.info("tenants reloaded", path=new.path, tenants=new.names,
                 added=sorted(set(new.by_name) - old), removed=sorted(old - set(new.by_name)))
        return True

    # -- internals --------------------------------------------------------------------------
    def _current(self, tenant: Tenant) -> Tenant:
        """The tenant as the file now says (a request that began before a reload holds the
        old object; a tenant since removed keeps its old limits until its requests end)."""
        return self.tenants.by_name.get(tenant.name, tenant)

    def _use(self, tenant: Tenant) -> Usage:
        use = self._usage.get(tenant.name)
        if use is None:
            use = self._usage[tenant.name] = Usage(updated=self._clock())
        return use

    def _refill(self, t: Tenant) -> Usage:
        use = self._use(t)
        now = self._clock()
        assert t.tokens_per_minute is not None
        cap = float(t.tokens_per_minute)
        if use.tokens == math.inf:
            use.tokens = cap
        use.tokens = min(cap, use.tokens + (now - use.updated) * cap / 60.0)
        use.updated = now
        return use


def duration(seconds: float) -> str:
    """OpenAI's form of a reset time: 6ms, 1.5s, 2m30s."""
    s = max(0.0, seconds)
    if s < 1.0:
        return f"{round(s * 1000)}ms"
    if s < 60.0:
        return f"{s:.3g}s"
    m, rest = divmod(s, 60.0)
    return f"{int(m)}m{rest:.0f}s"
