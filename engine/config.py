"""Configuration: one frozen dataclass per concern, composed into `EngineConfig`.

Checks run in `__post_init__`; derived values are properties; nothing is written back after
start-up. `ModelConfig.from_dir` reads a checkpoint's config.json (no transformers import).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, cast, get_args

from engine import config_fields, config_overrides
from engine.device_defaults import budget_source, default_batch_invariant, default_draft_cost
from engine.options import option
from engine.rope import RopeScaling
from engine.tokenizer import message_break
from engine.units import parse_bytes
from engine.vision.config import VisionConfig

if TYPE_CHECKING:
    import torch

_DTYPES = ("float32", "bfloat16", "float16")  # torch dtype names
DTypeName = Literal["auto", "float32", "bfloat16", "float16"]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class ModelConfig:
    """The text model of a Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoint, global (unsharded) sizes."""

    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]  # "linear_attention" (GDN) | "full_attention"
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    linear_num_key_heads: int  # Hk
    linear_num_value_heads: int  # Hv
    linear_key_head_dim: int  # dk
    linear_value_head_dim: int  # dv
    linear_conv_kernel_dim: int  # Kc
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: torch.dtype  # the weights' dtype at run time
    eos_token_ids: tuple[int, ...] = ()
    weight_prefix: str = "model."  # where the text model's weights live in the checkpoint
    # Mixture of experts (0 experts: every layer is a dense MLP of intermediate_size)
    num_experts: int = 0  # routed experts per MoE layer
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # each routed expert's intermediate size
    shared_expert_intermediate_size: int = 0  # the shared expert's (gated by sigmoid(shared_expert_gate(x)))
    norm_topk_prob: bool = True  # renormalise the k routing weights to sum to 1
    decoder_sparse_step: int = 1  # layer i is MoE when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    # FP8 block-quantized weights ([bn, bk] blocks, `*.weight_scale_inv` beside them)
    fp8_block_size: tuple[int, int] | None = None
    # routed experts of an FP8 checkpoint: kept in FP8 ("keep"), dequantized at load ("dequantize"),
    # or "auto": kept on CUDA (the fused MoE kernel dequantizes each tile as it loads it)
    fp8_experts: Literal["auto", "keep", "dequantize"] = "auto"
    # the dense projections (attention, GDN, MLPs, shared experts) likewise, through `Linear.fp8`
    fp8_dense: Literal["auto", "keep", "dequantize"] = "auto"
    batch_invariant: bool = False  # --batch-invariant (docs/engine.md, "Batch-invariant mode")
    mtp_num_layers: int = 0  # multi-token-prediction layers the config declares (`mtp.layers.*`)
    rope_scaling: RopeScaling = RopeScaling()  # YaRN / linear scaling of the rotary positions (engine/rope.py)
    vision: VisionConfig | None = None  # the vision tower of a vision-language checkpoint (docs/images.md)

    def __post_init__(self):
        bad = {t for t in self.layer_types if t not in ("linear_attention", "full_attention")}
        if bad:
            raise ValueError(f"unsupported layer types {sorted(bad)}; supported: linear_attention, full_attention")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads={self.linear_num_value_heads} must be a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads}"
            )
        if self.num_experts and not (1 <= self.num_experts_per_tok <= self.num_experts):
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts={self.num_experts}]"
            )
        if self.num_experts and (self.moe_intermediate_size <= 0 or self.shared_expert_intermediate_size <= 0):
            raise ValueError("an MoE model needs moe_intermediate_size and shared_expert_intermediate_size > 0")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of num_key_value_heads={self.num_kv_heads}"
            )

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i's MLP is the sparse MoE block (else a dense MLP of intermediate_size)."""
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    @property
    def fused_gdn_projections(self) -> bool:
        """Qwen3-Next stores GDN projections as in_proj_qkvz / in_proj_ba, grouped per key head."""
        return self.architecture == "Qwen3NextForCausalLM"

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    @config_overrides.one_line_errors
    def from_dir(
        cls,
        path: str | os.PathLike,
        dtype: DTypeName = "auto",
        *,
        check_only: bool = False,
        hf_overrides: str | None = None,
    ) -> ModelConfig:
        """check_only: the dtype a name, no torch (`up`'s checks); hf_overrides: engine/config_overrides.py."""
        cfg_path, raw = config_overrides.read_config(path, hf_overrides)
        arch = config_fields.architecture(raw, cfg_path)
        prefix = "model."
        text = raw
        if arch in config_fields.WRAPPERS:
            text = raw.get("text_config") or {}
            prefix = "model.language_model."
        want_type = config_fields.ARCHITECTURES[arch]
        if text.get("model_type", want_type) != want_type:
            raise ValueError(f"{arch} expects a {want_type} text model, found model_type {text.get('model_type')!r}")
        fp8_block = config_fields.fp8_block_size(
            raw.get("quantization_config") or text.get("quantization_config"), cfg_path
        )
        n_layers = text["num_hidden_layers"]
        layer_types = config_fields.layer_types(text, n_layers, cfg_path)
        rope = text.get("rope_parameters") or {}
        cfg_dtype = text.get("dtype") or text.get("torch_dtype") or raw.get("dtype") or "float32"
        want = cfg_dtype if dtype == "auto" else dtype
        if want not in _DTYPES:
            raise ValueError(f"unsupported dtype {want!r}; supported: auto, {', '.join(_DTYPES)}")
        return cls(
            path=str(path),
            architecture=arch,
            vocab_size=text["vocab_size"],
            hidden_size=text["hidden_size"],
            intermediate_size=text.get("intermediate_size", 0),  # Qwen3.5-MoE has no dense MLP
            layer_types=layer_types,
            num_attention_heads=text["num_attention_heads"],
            num_kv_heads=text["num_key_value_heads"],
            head_dim=text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"],
            linear_num_key_heads=text["linear_num_key_heads"],
            linear_num_value_heads=text["linear_num_value_heads"],
            linear_key_head_dim=text["linear_key_head_dim"],
            linear_value_head_dim=text["linear_value_head_dim"],
            linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4),
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", text.get("rope_theta", 10000.0)),
            partial_rotary_factor=rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)),
            max_position_embeddings=text.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            dtype=cast("torch.dtype", want) if check_only else getattr(importlib.import_module("torch"), want),
            eos_token_ids=config_fields.eos_token_ids(path, raw, text),
            weight_prefix=prefix,
            fp8_block_size=fp8_block,
            **config_fields.moe_fields(text, want_type),
            mtp_num_layers=int(text.get("mtp_num_hidden_layers", 0) or 0),
            rope_scaling=RopeScaling.from_text(text),
            vision=VisionConfig.from_raw(raw, text)
            if arch in config_fields.WRAPPERS and config_fields.has_processor(path)
            else None,
        )


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1  # ranks per node, one process each (gloo on CPU, nccl on CUDA)
    # t = 1 too: the rank in a process of its own (a serving node's --worker-process: its gRPC threads
    # never wait for the GIL behind the model's Python); False: rank 0 in the caller's process
    worker_process: bool = False

    def __post_init__(self):
        if self.tensor_parallel_size not in (1, 2, 4, 8):
            raise ValueError(f"tensor_parallel_size must be 1, 2, 4 or 8 (got {self.tensor_parallel_size})")

    def check_model(self, m: ModelConfig) -> None:
        """Every head count and intermediate size must split evenly; KV heads may instead be
        replicated (t > KVH)."""
        t = self.tensor_parallel_size
        sizes = [
            ("linear_num_key_heads", m.linear_num_key_heads),
            ("linear_num_value_heads", m.linear_num_value_heads),
            ("num_attention_heads", m.num_attention_heads),
        ]
        if len(m.moe_layers) < m.num_layers:  # some layer has a dense MLP
            sizes.append(("intermediate_size", m.intermediate_size))
        if m.moe_layers:  # each rank holds a slice of every expert's (and the shared expert's) intermediate
            sizes += [
                ("moe_intermediate_size", m.moe_intermediate_size),
                ("shared_expert_intermediate_size", m.shared_expert_intermediate_size),
            ]
        for name, count in sizes:
            if count % t:
                raise ValueError(f"tensor_parallel_size={t} does not divide {name}={count}")
        kvh = m.num_kv_heads
        if (t <= kvh and kvh % t) or (t > kvh and t % kvh):
            raise ValueError(f"tensor_parallel_size={t} and num_key_value_heads={kvh}: one must divide the other")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV page
    kv_cache_memory: int | str | None = "256MiB"  # budget for KV pages + GDN state slots, per rank
    num_state_slots: int | None = None  # GDN state slots; default max_num_seqs
    # prefix caching (engine/cache/prefix.py): shared pages + GDN snapshots (every `snapshot_interval` tokens, prompt ends)
    enable_prefix_caching: bool = True
    snapshot_interval: int = 256
    snapshot_fraction: float = 0.1  # the snapshot pool's share of the budget
    message_break: tuple[int, ...] = ()  # snapshots also before the last token of each of these (ChatML message breaks)
    encoder_cache_memory: int | str = "64MiB"  # vision-language models: image embeddings kept per rank
    recurrent_dtype: str = "float32"  # GDN recurrent state, a torch dtype name (--mamba-ssm-cache-dtype)
    gpu_memory_utilization: float | None = None  # share of the device to plan from (cache/memory_plan.py)
    staging_slots: int = 0  # a sender's bfloat16 slots for float32 GDN states (transfer/staging.py), in the budget

    def __post_init__(self):
        if self.recurrent_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"mamba_ssm_cache_dtype must be auto, float32 or bfloat16 (got {self.recurrent_dtype!r})")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two (got {self.block_size})")
        if self.snapshot_interval < 1:
            raise ValueError(f"prefix_snapshot_interval must be >= 1 (got {self.snapshot_interval})")
        if not 0.0 <= self.snapshot_fraction < 1.0:
            raise ValueError(f"prefix_snapshot_memory must be in [0, 1) (got {self.snapshot_fraction})")
        if self.memory_bytes <= 0 and (self.kv_cache_memory is not None or self.gpu_memory_utilization is None):
            raise ValueError(f"kv_cache_memory must be positive (got {self.kv_cache_memory!r})")

    @property
    def memory_bytes(self) -> int:
        return 0 if self.kv_cache_memory is None else parse_bytes(self.kv_cache_memory)  # 0: planned


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # requests in the running batch
    max_num_batched_tokens: int = 2048  # token budget of one step (chunked prefill splits prompts)
    max_model_len: int | None = None  # prompt + output tokens; default the model's max positions
    # prompt tokens batch-class requests get in one step while interactive ones are about (0: no cap)
    batch_chunk_tokens: int = 256
    batch_step_s: float = 0.01  # ... and what the measured rate computes in this time (priority.py; 0: off)
    # prompts with fewer than short_prompt_tokens left after their cached prefix take at most
    # short_step_tokens of a step altogether, each whole (0: no cap; docs/prefix-caching.md)
    short_prompt_tokens: int = 0
    short_step_tokens: int = 0

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if min(self.batch_chunk_tokens, self.batch_step_s, self.short_prompt_tokens, self.short_step_tokens) < 0:
            raise ValueError("batch_chunk_tokens, batch_step_ms and the short-prompt caps must be >= 0")


SpeculativeMethod = Literal["ngram", "mtp"]
SPECULATIVE_METHODS: tuple[str, ...] = get_args(SpeculativeMethod)


@dataclass(frozen=True)
class SpeculativeConfig:
    num_tokens: int = 0  # draft tokens verified per decode row (0: no speculation)
    # "ngram": prompt-lookup drafts (continue an earlier match of the last n tokens);
    # "mtp": the checkpoint's multi-token-prediction block (`mtp.*`) drafts, reused recursively for k > 1
    method: SpeculativeMethod = "ngram"
    ngram_max: int = 4  # longest suffix to look up
    ngram_min: int = 1  # shortest suffix to look up
    # Depth control (engine/scheduler/spec_depth.py): a request's draft depth drops by one (down to 1) when the
    # acceptance rate of its recent drafts (exponential average, weight `depth_ema`) falls under
    # `depth_lower`, and climbs back by one (up to num_tokens) when it exceeds `depth_raise`
    depth_lower: float = 0.3
    depth_raise: float = 0.6
    depth_ema: float = 0.5
    # Depth 0: at depth 1 a draft pays only when its acceptance exceeds `draft_cost`, the cost of
    # verifying and drafting one token relative to a plain decode step (1 + a tokens for 1 + c); under
    # it the request stops drafting and probes again (one draft) after `probe_interval` steps, the
    # wait doubling after each failed probe up to `probe_max`
    draft_cost: float = 0.5
    probe_interval: int = 8
    probe_max: int = 64

    def __post_init__(self):
        if self.num_tokens < 0 or self.num_tokens > 16:
            raise ValueError(f"speculative num_tokens must be in [0, 16] (got {self.num_tokens})")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; known: {', '.join(SPECULATIVE_METHODS)}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        if not 0.0 <= self.depth_lower <= self.depth_raise <= 1.0 or not 0.0 < self.depth_ema <= 1.0:
            raise ValueError("need 0 <= depth_lower <= depth_raise <= 1 and 0 < depth_ema <= 1")
        if not 0.0 <= self.draft_cost <= 1.0:
            raise ValueError(f"speculative draft_cost must be in [0, 1] (got {self.draft_cost})")
        if not 1 <= self.probe_interval <= self.probe_max:
            raise ValueError("need 1 <= probe_interval <= probe_max")

    @property
    def mtp(self) -> bool:
        """Drafts come from the model's MTP block (its KV is a cache kind of its own)."""
        return self.method == "mtp" and self.num_tokens > 0


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    device: str = "cpu"
    seed: int = 0
    cuda_graphs: bool = True  # --cuda-graphs: decode steps replayed from graphs captured at start-up (cuda, TP 1)

    def __post_init__(self):
        self.parallel.check_model(self.model)
        self.max_model_len  # noqa: B018  (checks max_model_len against the checkpoint's positions)
        if self.speculative.mtp and self.model.mtp_num_layers < 1:
            raise ValueError(
                f"speculative_method='mtp' needs the checkpoint's mtp.* weights; {self.model.path} declares none "
                "(config.json has no mtp_num_hidden_layers)"
            )
        if self.speculative.mtp and self.model.mtp_num_layers != 1:
            raise ValueError(
                f"speculative_method='mtp' supports one MTP layer; {self.model.path} declares {self.model.mtp_num_layers}"
            )

    @property
    def max_model_len(self) -> int:
        return config_fields.max_model_len(self.scheduler.max_model_len, self.model)

    @property
    def num_state_slots(self) -> int:
        return self.cache.num_state_slots or self.scheduler.max_num_seqs

    @property
    def snapshot_fraction(self) -> float:
        """The budget share of the prefix snapshot pool (0 with prefix caching off)."""
        c = self.cache
        return c.snapshot_fraction if c.enable_prefix_caching else 0.0


@dataclass(frozen=True)
class EngineArgs:
    """The flat engine settings a user gives (`LLM`, the node commands), turned into one
    EngineConfig by `engine_config()`. Node configs extend it with their own fields. Each field is
    an option of `pdserve prefill`, `decode` and `up` (engine/options.py)."""

    model: str = option(help="checkpoint directory (on the command line, default the built-in tiny model)")
    tensor_parallel_size: int = option(1, "tensor-parallel ranks of a node, one process each (1, 2, 4, 8)", flag="--tp")
    dtype: DTypeName = option("auto", "weights and activations (auto: the checkpoint's)")
    kv_cache_memory: int | str | None = option(
        None, "cache memory per rank, e.g. 2GiB (default on cpu 256MiB); on cuda it overrides --gpu-memory-utilization"
    )
    max_num_seqs: int = option(64, "requests in the running batch (and GDN state slots)")
    max_num_batched_tokens: int = option(
        2048,
        "token budget of one engine step (chunked prefill splits longer prompts); a prefill step is at most "
        "this long, and a reservation lease must outlast one",
    )
    block_size: int = option(16, "tokens per KV page (a power of two); prefill and decode nodes must agree")
    max_model_len: int | None = option(
        None,
        "prompt + output tokens at most (default or 0: the checkpoint's positions; more: VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)",
    )
    seed: int = option(0, "seed of the sampler for requests that name none")
    device: str = option("cpu", "cpu, cuda (rank r on visible GPU r) or cuda:N,M,... (rank r on the r-th listed)")
    num_speculative_tokens: int = option(
        0, "draft tokens verified per decode row (0: off); prefill and decode nodes must use the same value"
    )
    speculative_method: SpeculativeMethod = option(
        "ngram",
        "where drafts come from: ngram (prompt lookup) or mtp (the checkpoint's multi-token-prediction "
        "block); prefill and decode nodes must use the same method",
    )
    enable_prefix_caching: bool = option(
        True,
        "reuse the cached KV pages and GDN state snapshots of earlier prompts' prefixes",
        flag="--prefix-caching",
    )
    prefix_snapshot_interval: int = option(
        256, "prefix caching: save the GDN state every this many prompt tokens (and at each prompt's end)"
    )
    prefix_snapshot_memory: float = option(
        0.1, "prefix caching: share of the cache budget for GDN state snapshots (LRU-evicted when full)"
    )
    speculative_draft_cost: float | None = option(
        None,
        "cost of verifying and drafting one token relative to a plain decode step: a request whose draft "
        "acceptance falls under it stops drafting, probing again now and then (default: 0.5 on cpu, 0.1 on cuda)",
    )
    fp8_experts: Literal["auto", "keep", "dequantize"] = option(
        "auto",
        "FP8 checkpoints: keep the routed experts in FP8 (keep) or dequantize them at load (dequantize); "
        "auto keeps them on cuda (half the memory of bfloat16)",
    )
    fp8_dense: Literal["auto", "keep", "dequantize"] = option(
        "auto", "FP8 checkpoints: keep the dense projections in FP8 or dequantize them at load; auto keeps them on cuda"
    )
    batch_chunk_tokens: int = option(
        256, "prompt tokens batch-class requests get per step while interactive ones are about (0: no cap)"
    )
    batch_step_ms: float = option(
        10.0,
        "while interactive requests are about, batch-class prompt chunks also stay within what the node "
        "computes in this many milliseconds at its measured prompt rate (0: batch_chunk_tokens alone)",
    )
    encoder_cache_memory: int | str = option("64MiB", "image encoder outputs kept per rank, by pixel hash")
    mamba_ssm_cache_dtype: Literal["auto", "float32", "bfloat16"] = option(
        "auto",
        "GDN recurrent state (auto: float32); bfloat16 halves its slots' memory at some cost in exactness "
        "(docs/engine.md); prefill and decode nodes must use the same value",
    )
    batch_invariant: bool | None = option(
        None,
        "a request's logits the same bits however its prompt is chunked and whatever shares its steps, so a moved "
        "request continues exactly (docs/engine.md); default: on for bfloat16 on a CPU with AVX512-BF16; alike on all nodes",
    )
    gpu_memory_utilization: float | None = option(
        None, "cuda: share of each GPU for weights, a step's peak and the cache (default 0.9); ignored on cpu"
    )
    cuda_graphs: bool = option(
        True, "cuda, TP 1: replay decode steps from CUDA graphs captured at start-up", flag="--cuda-graphs"
    )
    hf_overrides: str | None = option(None, config_overrides.HELP)  # JSON text (engine/config_overrides.py)

    def engine_config(self, check_only: bool = False) -> EngineConfig:
        """check_only: `pdserve up`'s checks, without torch, C operators or tokenizer (the dtype a name)."""
        kv, share = budget_source(self.kv_cache_memory, self.gpu_memory_utilization, self.device)
        model = ModelConfig.from_dir(self.model, self.dtype, check_only=check_only, hf_overrides=self.hf_overrides)
        auto = self.batch_invariant is None and not check_only  # checks alone: unresolved (False)
        invariant = default_batch_invariant(model, self) if auto else bool(self.batch_invariant)
        return EngineConfig(
            model=dataclasses.replace(
                model, fp8_experts=self.fp8_experts, fp8_dense=self.fp8_dense, batch_invariant=invariant
            ),
            parallel=ParallelConfig(self.tensor_parallel_size),
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory=kv,
                gpu_memory_utilization=share,
                enable_prefix_caching=self.enable_prefix_caching,
                snapshot_interval=self.prefix_snapshot_interval,
                snapshot_fraction=self.prefix_snapshot_memory,
                message_break=message_break(self.model) if self.enable_prefix_caching and not check_only else (),
                encoder_cache_memory=self.encoder_cache_memory,
                recurrent_dtype="float32" if self.mamba_ssm_cache_dtype == "auto" else self.mamba_ssm_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                self.max_num_seqs,
                self.max_num_batched_tokens,
                self.max_model_len,
                self.batch_chunk_tokens,
                self.batch_step_ms / 1e3,
            ),
            speculative=SpeculativeConfig(
                num_tokens=self.num_speculative_tokens,
                method=self.speculative_method,
                draft_cost=default_draft_cost(self.device)
                if self.speculative_draft_cost is None
                else self.speculative_draft_cost,
            ),
            device=self.device,
            seed=self.seed,
            cuda_graphs=self.cuda_graphs,
        )
