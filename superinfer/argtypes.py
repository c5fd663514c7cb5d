"""argparse `type=` converters shared by the command lines (`sim`, `bench serve`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def positive(kind: type, name: str | None = None) -> Callable[[str], Any]:
    """A converter to `kind` (int, float) that refuses values <= 0; `name` words its errors
    (default: the type's name)."""
    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a {name or kind.__name__}: {text!r}") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(
                f"{name + 's ' if name else ''}must be positive, got {text}")
        return v
    return parse


# One request rate (req/s), > 0; `inf` is allowed (send everything at once).
rate = positive(float, "rate")


def rates(text: str) -> list[float]:
    """Comma-separated rates, at least one; empty items are ignored."""
    out = [rate(p.strip()) for p in text.split(",") if p.strip()]
    if not out:
        raise argparse.ArgumentTypeError("give at least one rate")
    return out
