from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Priority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_UNSPECIFIED: _ClassVar[Priority]
    PRIORITY_INTERACTIVE: _ClassVar[Priority]
    PRIORITY_BATCH: _ClassVar[Priority]

class NodeKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_KIND_UNSPECIFIED: _ClassVar[NodeKind]
    NODE_KIND_PREFILL: _ClassVar[NodeKind]
    NODE_KIND_DECODE: _ClassVar[NodeKind]
    NODE_KIND_ENCODE: _ClassVar[NodeKind]
PRIORITY_UNSPECIFIED: Priority
PRIORITY_INTERACTIVE: Priority
PRIORITY_BATCH: Priority
NODE_KIND_UNSPECIFIED: NodeKind
NODE_KIND_PREFILL: NodeKind
NODE_KIND_DECODE: NodeKind
NODE_KIND_ENCODE: NodeKind

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids", "ignore_eos", "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "prompt_logprobs", "stop", "num_speculative_tokens", "logit_bias", "min_p", "constraint", "priority", "include_stop_str_in_output", "skip_special_tokens", "cache_salt")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_tokens: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logprobs: int
    prompt_logprobs: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    num_speculative_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    min_p: float
    constraint: Constraint
    priority: Priority
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    cache_salt: str
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., num_speculative_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_p: _Optional[float] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ..., priority: _Optional[_Union[Priority, str]] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "grammar", "choice", "start_after_token")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    START_AFTER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    grammar: str
    choice: ChoiceList
    start_after_token: int
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ..., start_after_token: _Optional[int] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., rank: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_s", "ttft_s", "tpot_s", "e2e_s", "prefill_s", "transfer_s", "transfer_bytes")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TPOT_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    ttft_s: float
    tpot_s: float
    e2e_s: float
    prefill_s: float
    transfer_s: float
    transfer_bytes: int
    def __init__(self, queue_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., tpot_s: _Optional[float] = ..., e2e_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., transfer_bytes: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "sampling", "admission_timeout_s", "priority", "resume_token_ids", "images", "token_stream", "image_size")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STREAM_FIELD_NUMBER: _ClassVar[int]
    IMAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    admission_timeout_s: float
    priority: Priority
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    images: _containers.RepeatedCompositeFieldContainer[ImagePart]
    token_stream: str
    image_size: ImageSize
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., admission_timeout_s: _Optional[float] = ..., priority: _Optional[_Union[Priority, str]] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., images: _Optional[_Iterable[_Union[ImagePart, _Mapping]]] = ..., token_stream: _Optional[str] = ..., image_size: _Optional[_Union[ImageSize, _Mapping]] = ...) -> None: ...

class ImageSize(_message.Message):
    __slots__ = ("min_pixels", "max_pixels")
    MIN_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    min_pixels: int
    max_pixels: int
    def __init__(self, min_pixels: _Optional[int] = ..., max_pixels: _Optional[int] = ...) -> None: ...

class ImagePart(_message.Message):
    __slots__ = ("data", "url")
    DATA_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    url: str
    def __init__(self, data: _Optional[bytes] = ..., url: _Optional[str] = ...) -> None: ...

class ImageInput(_message.Message):
    __slots__ = ("data", "pixel_hash", "offset", "grid_thw", "min_pixels", "max_pixels")
    DATA_FIELD_NUMBER: _ClassVar[int]
    PIXEL_HASH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    MIN_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    pixel_hash: bytes
    offset: int
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    min_pixels: int
    max_pixels: int
    def __init__(self, data: _Optional[bytes] = ..., pixel_hash: _Optional[bytes] = ..., offset: _Optional[int] = ..., grid_thw: _Optional[_Iterable[int]] = ..., min_pixels: _Optional[int] = ..., max_pixels: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "timings", "prompt_tokens", "decode_node", "prefill_node", "logprobs", "prompt_logprobs", "cached_tokens", "muxed_tokens", "token_stream", "node_ended")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_NODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NODE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MUXED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STREAM_FIELD_NUMBER: _ClassVar[int]
    NODE_ENDED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    timings: Timings
    prompt_tokens: int
    decode_node: str
    prefill_node: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    cached_tokens: int
    muxed_tokens: int
    token_stream: bool
    node_ended: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., decode_node: _Optional[str] = ..., prefill_node: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., cached_tokens: _Optional[int] = ..., muxed_tokens: _Optional[int] = ..., token_stream: _Optional[bool] = ..., node_ended: _Optional[int] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ChatRequest(_message.Message):
    __slots__ = ("body_json", "resume")
    BODY_JSON_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    body_json: str
    resume: _containers.RepeatedCompositeFieldContainer[ChatResume]
    def __init__(self, body_json: _Optional[str] = ..., resume: _Optional[_Iterable[_Union[ChatResume, _Mapping]]] = ...) -> None: ...

class ChatResume(_message.Message):
    __slots__ = ("index", "token_ids", "finished")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ...) -> None: ...

class ChatChunk(_message.Message):
    __slots__ = ("choice_json", "usage_json", "token_ids")
    CHOICE_JSON_FIELD_NUMBER: _ClassVar[int]
    USAGE_JSON_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    choice_json: str
    usage_json: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, choice_json: _Optional[str] = ..., usage_json: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("id", "path", "vocab_size", "max_model_len", "has_tokenizer")
    ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    id: str
    path: str
    vocab_size: int
    max_model_len: int
    has_tokenizer: bool
    def __init__(self, id: _Optional[str] = ..., path: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., has_tokenizer: _Optional[bool] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class Capacity(_message.Message):
    __slots__ = ("total_blocks", "free_blocks", "block_size", "total_slots", "free_slots", "running", "waiting", "queued_prefill_tokens", "reserved")
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SLOTS_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    total_blocks: int
    free_blocks: int
    block_size: int
    total_slots: int
    free_slots: int
    running: int
    waiting: int
    queued_prefill_tokens: int
    reserved: int
    def __init__(self, total_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., total_slots: _Optional[int] = ..., free_slots: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., reserved: _Optional[int] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "kind", "address", "incarnation", "tp_size", "model", "vocab_size", "max_model_len", "local_prefill_threshold", "schema_digest", "prefill_ready", "capacity", "draining", "speculation", "prefix", "prefill_tokens_per_s", "local_resume_threshold", "requests_ended", "prefill_cost")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PREFILL_READY_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RESUME_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_ENDED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COST_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    kind: NodeKind
    address: str
    incarnation: int
    tp_size: int
    model: str
    vocab_size: int
    max_model_len: int
    local_prefill_threshold: int
    schema_digest: str
    prefill_ready: bool
    capacity: Capacity
    draining: bool
    speculation: Speculation
    prefix: PrefixDigest
    prefill_tokens_per_s: float
    local_resume_threshold: int
    requests_ended: int
    prefill_cost: PrefillCost
    def __init__(self, node_id: _Optional[str] = ..., kind: _Optional[_Union[NodeKind, str]] = ..., address: _Optional[str] = ..., incarnation: _Optional[int] = ..., tp_size: _Optional[int] = ..., model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., local_prefill_threshold: _Optional[int] = ..., schema_digest: _Optional[str] = ..., prefill_ready: _Optional[bool] = ..., capacity: _Optional[_Union[Capacity, _Mapping]] = ..., draining: _Optional[bool] = ..., speculation: _Optional[_Union[Speculation, _Mapping]] = ..., prefix: _Optional[_Union[PrefixDigest, _Mapping]] = ..., prefill_tokens_per_s: _Optional[float] = ..., local_resume_threshold: _Optional[int] = ..., requests_ended: _Optional[int] = ..., prefill_cost: _Optional[_Union[PrefillCost, _Mapping]] = ...) -> None: ...

class PrefillCost(_message.Message):
    __slots__ = ("s_per_token", "s_per_pair", "s_per_token_min")
    S_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    S_PER_PAIR_FIELD_NUMBER: _ClassVar[int]
    S_PER_TOKEN_MIN_FIELD_NUMBER: _ClassVar[int]
    s_per_token: float
    s_per_pair: float
    s_per_token_min: float
    def __init__(self, s_per_token: _Optional[float] = ..., s_per_pair: _Optional[float] = ..., s_per_token_min: _Optional[float] = ...) -> None: ...

class PrefixDigest(_message.Message):
    __slots__ = ("version", "block_size", "snapshot_interval", "pages", "snapshot_keys", "snapshot_tokens", "mtp")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_KEYS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MTP_FIELD_NUMBER: _ClassVar[int]
    version: int
    block_size: int
    snapshot_interval: int
    pages: _containers.RepeatedScalarFieldContainer[int]
    snapshot_keys: _containers.RepeatedScalarFieldContainer[int]
    snapshot_tokens: _containers.RepeatedScalarFieldContainer[int]
    mtp: bool
    def __init__(self, version: _Optional[int] = ..., block_size: _Optional[int] = ..., snapshot_interval: _Optional[int] = ..., pages: _Optional[_Iterable[int]] = ..., snapshot_keys: _Optional[_Iterable[int]] = ..., snapshot_tokens: _Optional[_Iterable[int]] = ..., mtp: _Optional[bool] = ...) -> None: ...

class Speculation(_message.Message):
    __slots__ = ("method", "num_tokens", "drafts_per_position", "accepted_per_position")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    method: str
    num_tokens: int
    drafts_per_position: _containers.RepeatedScalarFieldContainer[int]
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, method: _Optional[str] = ..., num_tokens: _Optional[int] = ..., drafts_per_position: _Optional[_Iterable[int]] = ..., accepted_per_position: _Optional[_Iterable[int]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: NodeInfo
    def __init__(self, node: _Optional[_Union[NodeInfo, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("heartbeat_interval_s",)
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_s: float
    def __init__(self, heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "incarnation", "capacity", "draining", "prefix", "prefill_tokens_per_s", "requests_ended", "prefill_cost")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_ENDED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COST_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: int
    capacity: Capacity
    draining: bool
    prefix: PrefixDigest
    prefill_tokens_per_s: float
    requests_ended: int
    prefill_cost: PrefillCost
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., capacity: _Optional[_Union[Capacity, _Mapping]] = ..., draining: _Optional[bool] = ..., prefix: _Optional[_Union[PrefixDigest, _Mapping]] = ..., prefill_tokens_per_s: _Optional[float] = ..., requests_ended: _Optional[int] = ..., prefill_cost: _Optional[_Union[PrefillCost, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known", "prefill_pool")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_POOL_FIELD_NUMBER: _ClassVar[int]
    known: bool
    prefill_pool: bool
    def __init__(self, known: _Optional[bool] = ..., prefill_pool: _Optional[bool] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node", "alive", "last_seen_s", "static")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_S_FIELD_NUMBER: _ClassVar[int]
    STATIC_FIELD_NUMBER: _ClassVar[int]
    node: NodeInfo
    alive: bool
    last_seen_s: float
    static: bool
    def __init__(self, node: _Optional[_Union[NodeInfo, _Mapping]] = ..., alive: _Optional[bool] = ..., last_seen_s: _Optional[float] = ..., static: _Optional[bool] = ...) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStatus]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeStatus, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetRank(_message.Message):
    __slots__ = ("agent", "rank", "block_ids", "slot", "incarnation")
    AGENT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    agent: str
    rank: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    slot: int
    incarnation: int
    def __init__(self, agent: _Optional[str] = ..., rank: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., slot: _Optional[int] = ..., incarnation: _Optional[int] = ...) -> None: ...

class TransferTarget(_message.Message):
    __slots__ = ("request_id", "node_id", "tp_size", "schema_digest", "num_tokens", "ranks", "lease_s", "cached_blocks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_DIGEST_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    node_id: str
    tp_size: int
    schema_digest: str
    num_tokens: int
    ranks: _containers.RepeatedCompositeFieldContainer[TargetRank]
    lease_s: float
    cached_blocks: int
    def __init__(self, request_id: _Optional[str] = ..., node_id: _Optional[str] = ..., tp_size: _Optional[int] = ..., schema_digest: _Optional[str] = ..., num_tokens: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[TargetRank, _Mapping]]] = ..., lease_s: _Optional[float] = ..., cached_blocks: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "lease_s", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    lease_s: float
    images: _containers.RepeatedCompositeFieldContainer[ImageInput]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., lease_s: _Optional[float] = ..., images: _Optional[_Iterable[_Union[ImageInput, _Mapping]]] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("target",)
    TARGET_FIELD_NUMBER: _ClassVar[int]
    target: TransferTarget
    def __init__(self, target: _Optional[_Union[TransferTarget, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "reason", "dead_prefill_node")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DEAD_PREFILL_NODE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    dead_prefill_node: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ..., dead_prefill_node: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "reserved", "first_token_id", "draft_token_ids", "resume_token_ids", "images", "token_stream")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STREAM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    reserved: bool
    first_token_id: int
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    images: _containers.RepeatedCompositeFieldContainer[ImageInput]
    token_stream: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., reserved: _Optional[bool] = ..., first_token_id: _Optional[int] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., images: _Optional[_Iterable[_Union[ImageInput, _Mapping]]] = ..., token_stream: _Optional[str] = ...) -> None: ...

class TokenStreamRequest(_message.Message):
    __slots__ = ("stream_id",)
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    def __init__(self, stream_id: _Optional[str] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "text", "last")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    text: str
    last: bool
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., text: _Optional[str] = ..., last: _Optional[bool] = ...) -> None: ...

class TokenBatch(_message.Message):
    __slots__ = ("deltas",)
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    deltas: _containers.RepeatedCompositeFieldContainer[TokenDelta]
    def __init__(self, deltas: _Optional[_Iterable[_Union[TokenDelta, _Mapping]]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "target", "images", "encoded")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    ENCODED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    target: TransferTarget
    images: _containers.RepeatedCompositeFieldContainer[ImageInput]
    encoded: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., target: _Optional[_Union[TransferTarget, _Mapping]] = ..., images: _Optional[_Iterable[_Union[ImageInput, _Mapping]]] = ..., encoded: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "timings", "finish_reason", "pushed", "draft_token_ids", "cached_tokens", "logprobs")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PUSHED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    timings: Timings
    finish_reason: str
    pushed: bool
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cached_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, first_token_id: _Optional[int] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., finish_reason: _Optional[str] = ..., pushed: _Optional[bool] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., cached_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "reason", "dead_decode_node")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DEAD_DECODE_NODE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    dead_decode_node: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ..., dead_decode_node: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("node_id", "incarnation", "schema")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: int
    schema: bytes
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., schema: _Optional[bytes] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("node_id", "incarnation", "schema")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: int
    schema: bytes
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., schema: _Optional[bytes] = ...) -> None: ...

class ReserveEncodedRequest(_message.Message):
    __slots__ = ("request_id", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    images: _containers.RepeatedCompositeFieldContainer[ImageInput]
    def __init__(self, request_id: _Optional[str] = ..., images: _Optional[_Iterable[_Union[ImageInput, _Mapping]]] = ...) -> None: ...

class ReserveEncodedResponse(_message.Message):
    __slots__ = ("cached", "landing")
    CACHED_FIELD_NUMBER: _ClassVar[int]
    LANDING_FIELD_NUMBER: _ClassVar[int]
    cached: _containers.RepeatedScalarFieldContainer[bytes]
    landing: bytes
    def __init__(self, cached: _Optional[_Iterable[bytes]] = ..., landing: _Optional[bytes] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "images", "landing")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    LANDING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    images: _containers.RepeatedCompositeFieldContainer[ImageInput]
    landing: bytes
    def __init__(self, request_id: _Optional[str] = ..., images: _Optional[_Iterable[_Union[ImageInput, _Mapping]]] = ..., landing: _Optional[bytes] = ...) -> None: ...

class EncodedImage(_message.Message):
    __slots__ = ("pixel_hash", "nbytes", "encode_s", "push_s")
    PIXEL_HASH_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    ENCODE_S_FIELD_NUMBER: _ClassVar[int]
    PUSH_S_FIELD_NUMBER: _ClassVar[int]
    pixel_hash: bytes
    nbytes: int
    encode_s: float
    push_s: float
    def __init__(self, pixel_hash: _Optional[bytes] = ..., nbytes: _Optional[int] = ..., encode_s: _Optional[float] = ..., push_s: _Optional[float] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("images",)
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedCompositeFieldContainer[EncodedImage]
    def __init__(self, images: _Optional[_Iterable[_Union[EncodedImage, _Mapping]]] = ...) -> None: ...
