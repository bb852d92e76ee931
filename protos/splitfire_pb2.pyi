from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "grammar", "resumed_tokens", "logit_bias", "min_tokens", "grammar_release")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_RELEASE_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    grammar: str
    resumed_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    grammar_release: str
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., grammar: _Optional[str] = ..., resumed_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., grammar_release: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "tenant", "prefill_endpoint", "tenant_weight", "adapter", "model", "priority", "traceparent")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TENANT_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    tenant: str
    prefill_endpoint: str
    tenant_weight: float
    adapter: str
    model: str
    priority: int
    traceparent: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., tenant: _Optional[str] = ..., prefill_endpoint: _Optional[str] = ..., tenant_weight: _Optional[float] = ..., adapter: _Optional[str] = ..., model: _Optional[str] = ..., priority: _Optional[int] = ..., traceparent: _Optional[str] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "finish_reason", "usage", "prefill_mode", "prefill_reason", "stop_string", "stop_token_id")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: str
    usage: Usage
    prefill_mode: str
    prefill_reason: str
    stop_string: str
    stop_token_id: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., prefill_mode: _Optional[str] = ..., prefill_reason: _Optional[str] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ...) -> None: ...

class KVDestination(_message.Message):
    __slots__ = ("segment", "base_address", "num_blocks", "num_layers", "page_bytes", "first_block", "block_ids", "ranks", "landing_block_ids", "kv_dtype")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    LANDING_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    segment: str
    base_address: int
    num_blocks: int
    num_layers: int
    page_bytes: int
    first_block: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    ranks: _containers.RepeatedCompositeFieldContainer[KVRank]
    landing_block_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_dtype: str
    def __init__(self, segment: _Optional[str] = ..., base_address: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_layers: _Optional[int] = ..., page_bytes: _Optional[int] = ..., first_block: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., ranks: _Optional[_Iterable[_Union[KVRank, _Mapping]]] = ..., landing_block_ids: _Optional[_Iterable[int]] = ..., kv_dtype: _Optional[str] = ...) -> None: ...

class KVSection(_message.Message):
    __slots__ = ("rank", "first", "count")
    RANK_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    rank: int
    first: int
    count: int
    def __init__(self, rank: _Optional[int] = ..., first: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class KVRank(_message.Message):
    __slots__ = ("segment", "base_address", "first_layer", "num_layers")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    segment: str
    base_address: int
    first_layer: int
    num_layers: int
    def __init__(self, segment: _Optional[str] = ..., base_address: _Optional[int] = ..., first_layer: _Optional[int] = ..., num_layers: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "tenant", "destination", "tenant_weight", "adapter", "priority", "traceparent")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    TENANT_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    tenant: str
    destination: KVDestination
    tenant_weight: float
    adapter: str
    priority: int
    traceparent: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., tenant: _Optional[str] = ..., destination: _Optional[_Union[KVDestination, _Mapping]] = ..., tenant_weight: _Optional[float] = ..., adapter: _Optional[str] = ..., priority: _Optional[int] = ..., traceparent: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "logprob", "cached_tokens", "computed_tokens", "transfer_bytes", "transfer_entries", "transfer_seconds", "compute_seconds", "queue_seconds", "landable", "landed")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LANDABLE_FIELD_NUMBER: _ClassVar[int]
    LANDED_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    logprob: TokenLogprob
    cached_tokens: int
    computed_tokens: int
    transfer_bytes: int
    transfer_entries: int
    transfer_seconds: float
    compute_seconds: float
    queue_seconds: float
    landable: _containers.RepeatedCompositeFieldContainer[KVSection]
    landed: bool
    def __init__(self, first_token: _Optional[int] = ..., logprob: _Optional[_Union[TokenLogprob, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., transfer_bytes: _Optional[int] = ..., transfer_entries: _Optional[int] = ..., transfer_seconds: _Optional[float] = ..., compute_seconds: _Optional[float] = ..., queue_seconds: _Optional[float] = ..., landable: _Optional[_Iterable[_Union[KVSection, _Mapping]]] = ..., landed: _Optional[bool] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found", "writes_settled")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    WRITES_SETTLED_FIELD_NUMBER: _ClassVar[int]
    found: bool
    writes_settled: bool
    def __init__(self, found: _Optional[bool] = ..., writes_settled: _Optional[bool] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("status", "role", "model", "block_size", "max_model_len", "stream_port", "stream_mux", "adapters", "models", "resident", "adapter_models")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    STREAM_PORT_FIELD_NUMBER: _ClassVar[int]
    STREAM_MUX_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_MODELS_FIELD_NUMBER: _ClassVar[int]
    status: str
    role: str
    model: str
    block_size: int
    max_model_len: int
    stream_port: int
    stream_mux: bool
    adapters: _containers.RepeatedScalarFieldContainer[str]
    models: _containers.RepeatedScalarFieldContainer[str]
    resident: _containers.RepeatedScalarFieldContainer[str]
    adapter_models: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, status: _Optional[str] = ..., role: _Optional[str] = ..., model: _Optional[str] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., stream_port: _Optional[int] = ..., stream_mux: _Optional[bool] = ..., adapters: _Optional[_Iterable[str]] = ..., models: _Optional[_Iterable[str]] = ..., resident: _Optional[_Iterable[str]] = ..., adapter_models: _Optional[_Iterable[str]] = ...) -> None: ...

class KVBlocksRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVBlocksResponse(_message.Message):
    __slots__ = ("seq", "hashes", "epoch", "enabled", "stream")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    seq: int
    hashes: bytes
    epoch: str
    enabled: bool
    stream: str
    def __init__(self, seq: _Optional[int] = ..., hashes: _Optional[bytes] = ..., epoch: _Optional[str] = ..., enabled: _Optional[bool] = ..., stream: _Optional[str] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "path", "model")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    model: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("rank", "load_seconds")
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    load_seconds: float
    def __init__(self, rank: _Optional[int] = ..., load_seconds: _Optional[float] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ("pending",)
    PENDING_FIELD_NUMBER: _ClassVar[int]
    pending: bool
    def __init__(self, pending: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("prompt_tokens_in_flight", "running", "waiting", "kv_blocks_total", "kv_blocks_used", "kv_blocks_free", "kv_blocks_cached", "kv_tokens_held", "prefix_query_tokens", "prefix_hit_tokens", "decode_tokens_remaining", "reserved", "store_hit_tokens")
    PROMPT_TOKENS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_HELD_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_REMAINING_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    STORE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens_in_flight: int
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_cached: int
    kv_tokens_held: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    decode_tokens_remaining: int
    reserved: int
    store_hit_tokens: int
    def __init__(self, prompt_tokens_in_flight: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., kv_blocks_cached: _Optional[int] = ..., kv_tokens_held: _Optional[int] = ..., prefix_query_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., decode_tokens_remaining: _Optional[int] = ..., reserved: _Optional[int] = ..., store_hit_tokens: _Optional[int] = ...) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("blocks_dropped", "blocks_unshared")
    BLOCKS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_UNSHARED_FIELD_NUMBER: _ClassVar[int]
    blocks_dropped: int
    blocks_unshared: int
    def __init__(self, blocks_dropped: _Optional[int] = ..., blocks_unshared: _Optional[int] = ...) -> None: ...
