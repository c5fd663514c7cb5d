from proto import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AttachReply(_message.Message):
    __slots__ = ("host_blocks", "pool_id", "host_pool_id")
    HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_POOL_ID_FIELD_NUMBER: _ClassVar[int]
    host_blocks: int
    pool_id: str
    host_pool_id: str
    def __init__(self, host_blocks: _Optional[int] = ..., pool_id: _Optional[str] = ..., host_pool_id: _Optional[str] = ...) -> None: ...

class BlockPairs(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: _containers.RepeatedScalarFieldContainer[int]
    dst: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, src: _Optional[_Iterable[int]] = ..., dst: _Optional[_Iterable[int]] = ...) -> None: ...

class TransferRequest(_message.Message):
    __slots__ = ("fence", "pool_id", "swap_out", "swap_in", "eager")
    FENCE_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    EAGER_FIELD_NUMBER: _ClassVar[int]
    fence: int
    pool_id: str
    swap_out: BlockPairs
    swap_in: BlockPairs
    eager: BlockPairs
    def __init__(self, fence: _Optional[int] = ..., pool_id: _Optional[str] = ..., swap_out: _Optional[_Union[BlockPairs, _Mapping]] = ..., swap_in: _Optional[_Union[BlockPairs, _Mapping]] = ..., eager: _Optional[_Union[BlockPairs, _Mapping]] = ...) -> None: ...

class TransferReply(_message.Message):
    __slots__ = ("fence", "d2h_s", "h2d_s", "total_s", "bytes_d2h", "bytes_h2d")
    FENCE_FIELD_NUMBER: _ClassVar[int]
    D2H_S_FIELD_NUMBER: _ClassVar[int]
    H2D_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_D2H_FIELD_NUMBER: _ClassVar[int]
    BYTES_H2D_FIELD_NUMBER: _ClassVar[int]
    fence: int
    d2h_s: float
    h2d_s: float
    total_s: float
    bytes_d2h: int
    bytes_h2d: int
    def __init__(self, fence: _Optional[int] = ..., d2h_s: _Optional[float] = ..., h2d_s: _Optional[float] = ..., total_s: _Optional[float] = ..., bytes_d2h: _Optional[int] = ..., bytes_h2d: _Optional[int] = ...) -> None: ...

class KVMemStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVMemStats(_message.Message):
    __slots__ = ("host_blocks", "pool_id", "transfers", "blocks_d2h", "blocks_h2d", "busy_s", "mode")
    HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_D2H_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_H2D_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    host_blocks: int
    pool_id: str
    transfers: int
    blocks_d2h: int
    blocks_h2d: int
    busy_s: float
    mode: str
    def __init__(self, host_blocks: _Optional[int] = ..., pool_id: _Optional[str] = ..., transfers: _Optional[int] = ..., blocks_d2h: _Optional[int] = ..., blocks_h2d: _Optional[int] = ..., busy_s: _Optional[float] = ..., mode: _Optional[str] = ...) -> None: ...
