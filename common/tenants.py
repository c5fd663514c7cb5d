"""The tenants file: who may call the server, and what each caller may use.

A TOML file names each tenant under ``[tenants.NAME]``::

    [tenants.search]
    keys = ["sha256:5e88…"]      # `superinfer tenants new-key` makes a key and this line
    weight = 1.0                  # its share when tenants contend (the scheduler's, later)
    priority = 0                  # vLLM's order, lower first: its requests may ask for this or later
    ttft_slo = 2.0                # seconds; the default of its requests (a request's own wins)
    tbt_slo = 0.1
    max_in_flight = 32            # optional: requests at once
    tokens_per_minute = 100000    # optional: prompt and output tokens

Keys are stored hashed (SHA-256 of the key's UTF-8): the file can be read by whoever runs
the server without revealing a key. A key is a random string of at least 128 bits (what
`new-key` makes), so an unsalted hash is as good as the key is long, and a request's
tenant is one dictionary lookup.

Parsing checks everything a reload could get wrong, and an error names the line:
``tenants.toml:7: tenants.search.weight must be > 0, got -1``. The gateway reads the file at
start and on SIGHUP (gateway/tenants.py); a bad file is refused and the old one stays.
"""

from __future__ import annotations

import hashlib
import math
import re
import secrets
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
HASH_RE = re.compile(r"sha256:[0-9a-f]{64}")
KEY_PREFIX = "sk-si-"

FIELDS = ("keys", "weight", "priority", "ttft_slo", "tbt_slo", "max_in_flight",
          "tokens_per_minute")
PRIORITY_RANGE = (-(2**31), 2**31 - 1)  # the wire's int32


class TenantsError(ValueError):
    """A tenants file that cannot be served; the message says where and what."""


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    key_hashes: tuple[str, ...]
    weight: float = 1.0
    priority: int = 0  # its requests' most urgent class (lower first)
    ttft_slo_s: float | None = None  # None: the server's default
    tbt_slo_s: float | None = None
    max_in_flight: int | None = None  # None: no per-tenant limit
    tokens_per_minute: int | None = None

    @property
    def limited(self) -> bool:
        return self.max_in_flight is not None or self.tokens_per_minute is not None


@dataclass(frozen=True, slots=True)
class Tenants:
    """A checked tenants file: tenants by name and by key hash."""

    path: str
    by_name: dict[str, Tenant]
    by_hash: dict[str, Tenant]

    def for_key(self, key: str) -> Tenant | None:
        return self.by_hash.get(hash_key(key))

    @property
    def names(self) -> list[str]:
        return sorted(self.by_name)


def hash_key(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    """A fresh API key: 192 random bits."""
    return KEY_PREFIX + secrets.token_urlsafe(24)


def load(path: str | Path) -> Tenants:
    """Read and check a tenants file, or raise TenantsError naming the file and line."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise TenantsError(f"{p}: cannot read the tenants file ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise TenantsError(f"{p}: not UTF-8 text ({e.reason})") from None
    return parse(text, str(p))


def parse(text: str, path: str = "tenants.toml") -> Tenants:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        # tomllib's message ends "(at line L, column C)"; put the line first, like ours.
        m = re.search(r"\(at line (\d+), column \d+\)$", str(e))
        where = f"{path}:{m.group(1)}" if m else path
        raise TenantsError(f"{where}: not valid TOML: {str(e).split(' (at line')[0]}") from None
    lines = _Lines(text, path)
    extra = sorted(set(doc) - {"tenants"})
    if extra:
        raise TenantsError(f"{lines.at(extra[0])}: unknown table or key {extra[0]!r}; "
                           "the file holds only [tenants.NAME] tables")
    table = doc.get("tenants")
    if not isinstance(table, dict) or not table:
        raise TenantsError(f"{path}: no tenants; add a [tenants.NAME] table with keys = [...]")
    by_name: dict[str, Tenant] = {}
    by_hash: dict[str, Tenant] = {}
    for name, spec in table.items():
        tenant = _tenant(name, spec, lines)
        for h in tenant.key_hashes:
            other = by_hash.get(h)
            if other is not None:
                raise TenantsError(f"{lines.at(name, 'keys')}: a key of tenant {name!r} is also "
                                   f"tenant {other.name!r}'s; a key belongs to one tenant")
            by_hash[h] = tenant
        by_name[name] = tenant
    return Tenants(path, by_name, by_hash)


def _tenant(name: str, spec: Any, lines: _Lines) -> Tenant:
    where = lines.at(name)
    if not NAME_RE.fullmatch(name):
        raise TenantsError(f"{where}: tenant name {name!r} must be 1-64 characters of "
                           "A-Z a-z 0-9 . _ -")
    if not isinstance(spec, dict):
        raise TenantsError(f"{where}: tenants.{name} must be a table ([tenants.{name}])")
    unknown = sorted(set(spec) - set(FIELDS))
    if unknown:
        raise TenantsError(f"{lines.at(name, unknown[0])}: tenants.{name} has no field "
                           f"{unknown[0]!r}; the fields are {', '.join(FIELDS)}")

    def bad(field: str, why: str) -> TenantsError:
        return TenantsError(f"{lines.at(name, field)}: tenants.{name}.{field} {why}, "
                            f"got {spec[field]!r}")

    keys = spec.get("keys")
    if keys is None:
        raise TenantsError(f"{where}: tenants.{name} has no keys; add keys = [\"sha256:...\"] "
                           "(`superinfer tenants new-key` makes one)")
    if not isinstance(keys, list) or not keys or not all(isinstance(k, str) for k in keys):
        raise bad("keys", "must be a non-empty list of \"sha256:<64 hex digits>\" strings")
    for k in keys:
        if not HASH_RE.fullmatch(k):
            hint = ("; it looks like a plain key: store its hash (`superinfer tenants "
                    "hash-key`)") if not k.startswith("sha256:") else ""
            raise TenantsError(f"{lines.at(name, 'keys')}: tenants.{name}.keys holds "
                               f"{_shown(k)}, not \"sha256:<64 lowercase hex digits>\"{hint}")

    def number(field: str, default: float | None, *, integer: bool = False,
               low: float | None = None, low_ok: bool = False) -> Any:
        if field not in spec:
            return default
        v = spec[field]
        if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
            raise bad(field, "must be an integer" if integer else "must be a number")
        if not integer and not math.isfinite(v):
            raise bad(field, "must be finite")
        if low is not None and (v < low or (v == low and not low_ok)):
            raise bad(field, f"must be {'>=' if low_ok else '>'} {low:g}")
        return float(v) if not integer else int(v)

    priority = number("priority", 0, integer=True)
    if not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]:
        raise bad("priority", "must fit in 32 bits")
    return Tenant(
        name=name,
        key_hashes=tuple(dict.fromkeys(keys)),
        weight=number("weight", 1.0, low=0.0),
        priority=priority,
        ttft_slo_s=number("ttft_slo", None, low=0.0),
        tbt_slo_s=number("tbt_slo", None, low=0.0),
        max_in_flight=number("max_in_flight", None, integer=True, low=1, low_ok=True),
        tokens_per_minute=number("tokens_per_minute", None, integer=True, low=1, low_ok=True),
    )


def _shown(key: str) -> str:
    """A wrong entry, without printing a plain key whole into a log."""
    return repr(key) if key.startswith("sha256:") or len(key) < 8 else repr(key[:4] + "…")


class _Lines:
    """Where a tenant's table, or a field of it, is written (for error messages)."""

    def __init__(self, text: str, path: str) -> None:
        self.rows = text.splitlines()
        self.path = path

    def at(self, name: str, field: str | None = None) -> str:
        return f"{self.path}:{self._line(name, field)}"

    def _line(self, name: str, field: str | None) -> int:
        q = re.escape(name)
        header = re.compile(rf"^\s*\[\s*tenants\s*\.\s*(?:{q}|\"{q}\"|'{q}')\s*\]")
        start = next((i for i, row in enumerate(self.rows) if header.match(row)), None)
        if start is None:  # not a [tenants.NAME] table: the first line that names it
            key = re.compile(rf"(^|[\s.\"']){q}([\s.\"'=]|$)")
            return next((i + 1 for i, row in enumerate(self.rows) if key.search(row)), 1)
        if field is None:
            return start + 1
        assign = re.compile(rf"^\s*{re.escape(field)}\s*=")
        for i in range(start + 1, len(self.rows)):
            if self.rows[i].lstrip().startswith("["):
                break
            if assign.match(self.rows[i]):
                return i + 1
        return start + 1
