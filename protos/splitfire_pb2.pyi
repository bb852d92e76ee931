from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("frequency_penalty", "ignore_eos", "logprobs", "max_tokens", "min_p", "presence_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids", "temperature", "top_k", "top_p")
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
    def __init__(self, max_tokens: int | None = ..., temperature: float | None = ..., top_p: float | None = ..., top_k: int | None = ..., min_p: float | None = ..., repetition_penalty: float | None = ..., frequency_penalty: float | None = ..., presence_penalty: float | None = ..., seed: int | None = ..., stop: _Iterable[str] | None = ..., stop_token_ids: _Iterable[int] | None = ..., ignore_eos: bool | None = ..., logprobs: int | None = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("logprob", "token_id", "top_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: int | None = ..., logprob: float | None = ..., top_ids: _Iterable[int] | None = ..., top_logprobs: _Iterable[float] | None = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("cached_tokens", "completion_tokens", "prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: int | None = ..., completion_tokens: int | None = ..., cached_tokens: int | None = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prefill_endpoint", "request_id", "sampling", "tenant", "token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    tenant: str
    prefill_endpoint: str
    def __init__(self, request_id: str | None = ..., token_ids: _Iterable[int] | None = ..., sampling: SamplingParams | _Mapping | None = ..., tenant: str | None = ..., prefill_endpoint: str | None = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("finish_reason", "logprobs", "prefill_mode", "prefill_reason", "text", "token_ids", "usage")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_REASON_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: str
    usage: Usage
    prefill_mode: str
    prefill_reason: str
    def __init__(self, token_ids: _Iterable[int] | None = ..., text: str | None = ..., logprobs: _Iterable[TokenLogprob | _Mapping] | None = ..., finish_reason: str | None = ..., usage: Usage | _Mapping | None = ..., prefill_mode: str | None = ..., prefill_reason: str | None = ...) -> None: ...

class KVDestination(_message.Message):
    __slots__ = ("base_address", "block_ids", "first_block", "num_blocks", "num_layers", "page_bytes", "segment")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    segment: str
    base_address: int
    num_blocks: int
    num_layers: int
    page_bytes: int
    first_block: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, segment: str | None = ..., base_address: int | None = ..., num_blocks: int | None = ..., num_layers: int | None = ..., page_bytes: int | None = ..., first_block: int | None = ..., block_ids: _Iterable[int] | None = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("destination", "request_id", "sampling", "tenant", "token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    tenant: str
    destination: KVDestination
    def __init__(self, request_id: str | None = ..., token_ids: _Iterable[int] | None = ..., sampling: SamplingParams | _Mapping | None = ..., tenant: str | None = ..., destination: KVDestination | _Mapping | None = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("cached_tokens", "compute_seconds", "computed_tokens", "first_token", "logprob", "queue_seconds", "transfer_bytes", "transfer_entries", "transfer_seconds")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    logprob: TokenLogprob
    cached_tokens: int
    computed_tokens: int
    transfer_bytes: int
    transfer_entries: int
    transfer_seconds: float
    compute_seconds: float
    queue_seconds: float
    def __init__(self, first_token: int | None = ..., logprob: TokenLogprob | _Mapping | None = ..., cached_tokens: int | None = ..., computed_tokens: int | None = ..., transfer_bytes: int | None = ..., transfer_entries: int | None = ..., transfer_seconds: float | None = ..., compute_seconds: float | None = ..., queue_seconds: float | None = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: str | None = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: bool | None = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("block_size", "max_model_len", "model", "role", "status")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    status: str
    role: str
    model: str
    block_size: int
    max_model_len: int
    def __init__(self, status: str | None = ..., role: str | None = ..., model: str | None = ..., block_size: int | None = ..., max_model_len: int | None = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("decode_tokens_remaining", "kv_blocks_cached", "kv_blocks_free", "kv_blocks_total", "kv_blocks_used", "kv_tokens_held", "prefix_hit_tokens", "prefix_query_tokens", "prompt_tokens_in_flight", "reserved", "running", "waiting")
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
    def __init__(self, prompt_tokens_in_flight: int | None = ..., running: int | None = ..., waiting: int | None = ..., kv_blocks_total: int | None = ..., kv_blocks_used: int | None = ..., kv_blocks_free: int | None = ..., kv_blocks_cached: int | None = ..., kv_tokens_held: int | None = ..., prefix_query_tokens: int | None = ..., prefix_hit_tokens: int | None = ..., decode_tokens_remaining: int | None = ..., reserved: int | None = ...) -> None: ...
