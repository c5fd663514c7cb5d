"""`superinfer tenants`: make keys, hash them, and check a tenants file before a reload.

* `new-key NAME`: a fresh random key (printed once: give it to the tenant) and the line
  for the tenants file, which holds only its hash.
* `hash-key`: the hash line of a key read from stdin (never from the command line, where
  every local user could read it in `ps`).
* `check FILE`: what the gateway would say of the file: its tenants, or the wrong line.
"""

from __future__ import annotations

import argparse
import sys

from common.tenants import TenantsError, hash_key, load, new_key


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tenants", help="make and hash API keys, check a tenants file")
    cmds = p.add_subparsers(dest="tenants_command", required=True)
    n = cmds.add_parser("new-key", help="a new random API key and its tenants-file entry")
    n.add_argument("name", help="the tenant it is for (only printed in the entry)")
    n.set_defaults(func=_new_key)
    h = cmds.add_parser("hash-key", help="the tenants-file entry of a key read from stdin")
    h.set_defaults(func=_hash_key)
    c = cmds.add_parser("check", help="check a tenants file as the gateway would")
    c.add_argument("file")
    c.set_defaults(func=_check)


def _new_key(args: argparse.Namespace) -> int:
    key = new_key()
    print(f"key (give it to {args.name}; it is not stored anywhere): {key}", file=sys.stderr)
    print(f"[tenants.{args.name}]\nkeys = [\"{hash_key(key)}\"]")
    return 0


def _hash_key(args: argparse.Namespace) -> int:
    key = sys.stdin.readline().strip()
    if not key:
        print("superinfer tenants hash-key: error: no key on stdin", file=sys.stderr)
        return 2
    print(f"\"{hash_key(key)}\"")
    return 0


def _check(args: argparse.Namespace) -> int:
    try:
        tenants = load(args.file)
    except TenantsError as e:
        print(f"superinfer tenants check: error: {e}", file=sys.stderr)
        return 1
    for t in tenants.by_name.values():
        limits = [f"{v} {k}" for k, v in (("in flight", t.max_in_flight),
                                            ("tokens/min", t.tokens_per_minute)) if v is not None]
        print(f"{t.name}: {len(t.key_hashes)} key(s), weight {t.weight:g}, priority {t.priority}, "
              f"SLOs ttft {t.ttft_slo_s or 'server'} tbt {t.tbt_slo_s or 'server'}, "
              f"limits: {', '.join(limits) or 'none'}")
    return 0
