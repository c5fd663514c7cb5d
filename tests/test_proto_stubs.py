"""The checked-in gRPC stubs are exactly what `make proto` generates from proto/*.proto."""

from __future__ import annotations

import filecmp
from pathlib import Path

import pytest

grpc_tools = pytest.importorskip("grpc_tools")
from grpc_tools import protoc  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROTOS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "proto").glob("*.proto"))


def test_stubs_are_up_to_date(tmp_path: Path) -> None:
    assert PROTOS, "no .proto files found"
    include = str(Path(protoc.__file__).parent / "_proto")  # google/protobuf/*.proto
    rc = protoc.main([
        "grpc_tools.protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={tmp_path}",
        f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}",
        *(str(ROOT / p) for p in PROTOS),
    ])
    assert rc == 0, "protoc failed"
    generated = sorted(p.name for p in (tmp_path / "proto").iterdir())
    assert generated, "protoc wrote nothing"
    stale = [name for name in generated
             if not (ROOT / "proto" / name).is_file()
             or not filecmp.cmp(tmp_path / "proto" / name, ROOT / "proto" / name, shallow=False)]
    assert not stale, f"stale or missing stubs: {stale}; run `make proto` and commit the result"
