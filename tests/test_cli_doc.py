"""docs/cli.md is generated from the parser: it fails here when a flag changed without it."""

from __future__ import annotations

from superinfer.cli_doc import PAGE, render


def test_the_cli_page_matches_the_parser() -> None:
    assert PAGE.read_text() == render(), "docs/cli.md is stale: run `make cli-doc`"
