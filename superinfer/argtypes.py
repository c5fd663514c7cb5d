"""argparse `type=` converters shared by the command lines (`sim`, `bench serve`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def rate(text: str) -> float:
    """One request rate (req/s), > 0; `inf` is allowed (send everything at once)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a rate: {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"rates must be positive, got {text}")
    return v


def rates(text: str) -> list[float]:
    """Comma-separated rates, at least one; empty items are ignored."""
    out = [rate(p.strip()) for p in text.split(",") if p.strip()]
    if not out:
        raise argparse.ArgumentTypeError("give at least one rate")
    return out


def positive(kind: type) -> Callable[[str], Any]:
    """A converter to `kind` (int, float) that refuses values <= 0."""
    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a {kind.__name__}: {text!r}") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return v
    return parse
