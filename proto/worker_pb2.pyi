from proto import common_pb2 as _common_pb2
from proto import scheduler_pb2 as _scheduler_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Chunk(_message.Message):
    __slots__ = ("request_id", "token_ids", "start_pos", "block_table", "sample", "temperature", "top_p", "top_k", "seed", "output_index", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "prompt_logprob_targets", "stateful", "state", "num_draft")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    START_POS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_INDEX_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROB_TARGETS_FIELD_NUMBER: _ClassVar[int]
    STATEFUL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    start_pos: int
    block_table: _containers.RepeatedScalarFieldContainer[int]
    sample: bool
    temperature: float
    top_p: float
    top_k: int
    seed: int
    output_index: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logprobs: int
    prompt_logprob_targets: _containers.RepeatedScalarFieldContainer[int]
    stateful: bool
    state: _common_pb2.SamplingState
    num_draft: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., start_pos: _Optional[int] = ..., block_table: _Optional[_Iterable[int]] = ..., sample: _Optional[bool] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., output_index: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logprobs: _Optional[int] = ..., prompt_logprob_targets: _Optional[_Iterable[int]] = ..., stateful: _Optional[bool] = ..., state: _Optional[_Union[_common_pb2.SamplingState, _Mapping]] = ..., num_draft: _Optional[int] = ...) -> None: ...

class ExecuteRequest(_message.Message):
    __slots__ = ("iteration", "chunks", "pool_id", "after_iteration", "released")
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_ITERATION_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    iteration: int
    chunks: _containers.RepeatedCompositeFieldContainer[Chunk]
    pool_id: str
    after_iteration: int
    released: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, iteration: _Optional[int] = ..., chunks: _Optional[_Iterable[_Union[Chunk, _Mapping]]] = ..., pool_id: _Optional[str] = ..., after_iteration: _Optional[int] = ..., released: _Optional[_Iterable[str]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, tokens: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class ExecuteReply(_message.Message):
    __slots__ = ("request_ids", "token_ids", "execute_s", "logprobs", "prompt_logprobs", "accepted", "accepted_logprobs")
    class LogprobsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _common_pb2.TokenLogprob
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ...) -> None: ...
    class PromptLogprobsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: PromptLogprobs
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[PromptLogprobs, _Mapping]] = ...) -> None: ...
    class AcceptedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: TokenIds
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[TokenIds, _Mapping]] = ...) -> None: ...
    class AcceptedLogprobsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: PromptLogprobs
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[PromptLogprobs, _Mapping]] = ...) -> None: ...
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_S_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    execute_s: float
    logprobs: _containers.MessageMap[str, _common_pb2.TokenLogprob]
    prompt_logprobs: _containers.MessageMap[str, PromptLogprobs]
    accepted: _containers.MessageMap[str, TokenIds]
    accepted_logprobs: _containers.MessageMap[str, PromptLogprobs]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., token_ids: _Optional[_Iterable[int]] = ..., execute_s: _Optional[float] = ..., logprobs: _Optional[_Mapping[str, _common_pb2.TokenLogprob]] = ..., prompt_logprobs: _Optional[_Mapping[str, PromptLogprobs]] = ..., accepted: _Optional[_Mapping[str, TokenIds]] = ..., accepted_logprobs: _Optional[_Mapping[str, PromptLogprobs]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class KVPoolRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVPoolHandle(_message.Message):
    __slots__ = ("pool_id", "kind", "shm_name", "cuda_ipc_handle", "device_index", "shape", "dtype", "nbytes", "shard_shm_names")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SHARD_SHM_NAMES_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    kind: str
    shm_name: str
    cuda_ipc_handle: bytes
    device_index: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    nbytes: int
    shard_shm_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, pool_id: _Optional[str] = ..., kind: _Optional[str] = ..., shm_name: _Optional[str] = ..., cuda_ipc_handle: _Optional[bytes] = ..., device_index: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., nbytes: _Optional[int] = ..., shard_shm_names: _Optional[_Iterable[str]] = ...) -> None: ...
