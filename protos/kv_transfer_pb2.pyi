from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVLayout(_message.Message):
    __slots__ = ("model_id", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    def __init__(self, model_id: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("request_id", "layout", "block_indices", "layer_start", "layer_end", "max_chunk_bytes", "pair_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDICES_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    layout: KVLayout
    block_indices: _containers.RepeatedScalarFieldContainer[int]
    layer_start: int
    layer_end: int
    max_chunk_bytes: int
    pair_id: str
    def __init__(self, request_id: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., block_indices: _Optional[_Iterable[int]] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ..., pair_id: _Optional[str] = ...) -> None: ...

class ChunkHeader(_message.Message):
    __slots__ = ("layer_start", "layer_end", "block_start", "block_end", "num_bytes", "xxh3_64")
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    BLOCK_START_FIELD_NUMBER: _ClassVar[int]
    BLOCK_END_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    XXH3_64_FIELD_NUMBER: _ClassVar[int]
    layer_start: int
    layer_end: int
    block_start: int
    block_end: int
    num_bytes: int
    xxh3_64: int
    def __init__(self, layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., block_start: _Optional[int] = ..., block_end: _Optional[int] = ..., num_bytes: _Optional[int] = ..., xxh3_64: _Optional[int] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: ChunkHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[ChunkHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("layout", "num_leases", "dist_backend")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_FIELD_NUMBER: _ClassVar[int]
    DIST_BACKEND_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayout
    num_leases: int
    dist_backend: str
    def __init__(self, layout: _Optional[_Union[KVLayout, _Mapping]] = ..., num_leases: _Optional[int] = ..., dist_backend: _Optional[str] = ...) -> None: ...

class ConnectRequest(_message.Message):
    __slots__ = ("pair_id", "layout")
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    pair_id: str
    layout: KVLayout
    def __init__(self, pair_id: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ...) -> None: ...

class ConnectResponse(_message.Message):
    __slots__ = ("store_host", "store_port", "backend", "timeout_ms")
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    store_host: str
    store_port: int
    backend: str
    timeout_ms: int
    def __init__(self, store_host: _Optional[str] = ..., store_port: _Optional[int] = ..., backend: _Optional[str] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class DisconnectRequest(_message.Message):
    __slots__ = ("pair_id",)
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    pair_id: str
    def __init__(self, pair_id: _Optional[str] = ...) -> None: ...

class DisconnectResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
