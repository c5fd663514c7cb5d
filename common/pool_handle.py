"""The CUDA IPC part of a KV pool handle (proto KVPoolHandle.cuda_ipc_handle), encoded.

`torch.UntypedStorage._share_cuda_()` describes a CUDA allocation as a tuple of bytes and
numbers; the worker sends it, kvmem rebuilds the storage from it. It travels as JSON with
bytes in base64: no pickle on the wire.
"""

from __future__ import annotations

import base64
import json


def encode_cuda_ipc(fields: tuple[object, ...]) -> bytes:
    out = [{"b64": base64.b64encode(f).decode()} if isinstance(f, bytes) else f for f in fields]
    return json.dumps(out).encode()


def decode_cuda_ipc(blob: bytes) -> tuple[object, ...]:
    items = json.loads(blob)
    return tuple(base64.b64decode(i["b64"]) if isinstance(i, dict) else i for i in items)
