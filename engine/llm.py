"""LLM: the offline entry point. `LLM(path).generate(...)` runs a batch to completion."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from engine.cache.allocator import Capacity
from engine.config import EngineArgs
from engine.config_fields import DTYPE_ALIASES
from engine.core import EngineCore
from engine.llm_process import EngineProcess, Interrupted
from engine.llm_prompts import expand_prompts, parse_prompts
from engine.llm_results import by_prompt, each_completion, finish
from engine.llm_text import Stopped, TextWatch
from engine.llm_vllm import check_image_counts, conversations, mm_limits, render_chat, speculative
from engine.options import options
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from engine.vision.inputs import ImageInput

log = logging.getLogger("pdserve.llm")
# LLM.__init__'s locals that are not handed to an engine process (read, or mapped, in this one)
NOT_FORWARDED = (
    "self",
    "engine_process",
    "resolve",
    "speculative_config",
    "enforce_eager",
    "trust_remote_code",
    "spec",
    "text",
    "defaults",
)


class LLM:
    def __init__(
        self,
        model: str,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        kv_cache_memory: int | str | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        block_size: int = 16,
        max_model_len: int | None = None,
        seed: int = 0,
        device: str = "cpu",
        num_speculative_tokens: int = 0,
        speculative_method: str = "ngram",
        enable_prefix_caching: bool = True,
        prefix_snapshot_interval: int = 256,
        prefix_snapshot_memory: float = 0.1,
        speculative_draft_cost: float | None = None,
        fp8_experts: str = "auto",
        fp8_dense: str = "auto",
        engine_process: bool | None = None,
        batch_chunk_tokens: int = 256,
        batch_step_ms: float = 10.0,
        encoder_cache_memory: int | str = "64MiB",
        mamba_ssm_cache_dtype: str = "auto",
        batch_invariant: bool | None = None,
        gpu_memory_utilization: float | None = None,
        cuda_graphs: bool | None = None,
        speculative_config: dict | None = None,
        enforce_eager: bool = False,
        trust_remote_code: bool = False,
        limit_mm_per_prompt: dict | None = None,
        hf_overrides: dict | str | None = None,
        generation_config: str = "auto",
        override_generation_config: dict | str | None = None,
    ):
        """engine_process: run the engine in a process of its own (engine/llm_process.py); None
        (default): on the CPU when torch was imported before the engine, whose OpenMP threads would
        otherwise spin on the engine's cores; in this process otherwise. model: a checkpoint
        directory, or a Hugging Face repo id (engine/hub.py). vLLM's speculative_config,
        enforce_eager (no CUDA graphs), trust_remote_code (no effect: no remote code runs) and
        limit_mm_per_prompt are read as pdserve's options (engine/llm_vllm.py). hf_overrides: a dict
        (or its JSON text) merged into the checkpoint's config.json, as vLLM's
        (engine/config_overrides.py). generation_config, override_generation_config: the sampling
        parameters `generate` uses when it is given none, as vLLM's (engine/generation_defaults.py)."""
        from engine.config_overrides import text
        from engine.generation_defaults import defaults
        from engine.hub import resolve

        model, dtype = resolve(model), DTYPE_ALIASES.get(dtype, dtype)  # vLLM's "half", "bf16", "float" too
        hf_overrides = text(hf_overrides, "hf_overrides")
        self._sampling_defaults = defaults(model, generation_config, override_generation_config)
        if speculative_config is not None:
            if num_speculative_tokens != 0 or speculative_method != "ngram":
                raise ValueError("give speculative_config or num_speculative_tokens / speculative_method, not both")
            spec = speculative(speculative_config, "speculative_config")
            num_speculative_tokens = int(spec.get("num_speculative_tokens", 0))
            speculative_method = str(spec.get("speculative_method", "ngram"))
        if enforce_eager and cuda_graphs:
            raise ValueError("enforce_eager=True and cuda_graphs=True contradict each other")
        cuda_graphs = not enforce_eager if cuda_graphs is None else cuda_graphs
        self._mm_limits = mm_limits(limit_mm_per_prompt)
        self._model_path = model
        self._hf_tokenizer: Any = None
        kwargs = {k: v for k, v in locals().items() if k not in NOT_FORWARDED}
        if engine_process is None:
            import engine

            engine_process = str(device).startswith("cpu") and engine.TORCH_LOADED_FIRST
        self._proc: EngineProcess | None = None
        # between engine steps: True when the call is given up (set by the engine process's loop)
        self.interrupted: Callable[[], bool] | None = None
        if engine_process:
            self._proc = EngineProcess(kwargs)
            self.engine: EngineCore | None = None
            return
        args = EngineArgs(
            model,
            tensor_parallel_size,
            dtype,
            kv_cache_memory,
            max_num_seqs,
            max_num_batched_tokens,
            block_size,
            max_model_len,
            seed,
            device,
            num_speculative_tokens,
            speculative_method,
            enable_prefix_caching,
            prefix_snapshot_interval,
            prefix_snapshot_memory,
            speculative_draft_cost,
            fp8_experts,
            fp8_dense,
            batch_chunk_tokens,
            batch_step_ms,
            encoder_cache_memory,
            mamba_ssm_cache_dtype,
            batch_invariant,
            gpu_memory_utilization,
            cuda_graphs,
            hf_overrides=hf_overrides,
        )
        for o in options(EngineArgs):  # what the command line's choices refuse, refused here too
            if o.choices and getattr(args, o.name) not in o.choices:
                raise ValueError(
                    f"{o.name} must be one of {', '.join(map(str, o.choices))} (got {getattr(args, o.name)!r})"
                )
        self.config = args.engine_config()
        self.tokenizer = Tokenizer(model) if Tokenizer.exists(model) else None
        self.engine = EngineCore(self.config)
        warn_openmp_policy(device)

    def _engine(self) -> EngineCore:
        if self.engine is None:
            raise RuntimeError("the LLM is closed")
        return self.engine

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses when given no sampling_params: the checkpoint's generation_config.json
        values (vLLM's method), or the neutral defaults."""
        return SamplingParams(**self._sampling_defaults)

    def capacity(self) -> Capacity:
        if self._proc is not None:
            return self._proc.call("capacity")  # type: ignore[no-any-return]
        return self._engine().capacity

    def generate(
        self,
        prompts: Any = None,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        prompt_token_ids: Any = None,
        images: list[tuple[ImageInput, ...]] | None = None,
        use_tqdm: Any = True,
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        """prompts: a str, {"prompt": str}, {"prompt_token_ids": [int, ...]} (either with
        "multi_modal_data": {"image": ...}) or a list of them; or prompt_token_ids: [[int, ...], ...]
        (engine/llm_prompts.py). images: per prompt, its images on their <|image_pad|> runs
        (docs/images.md). vLLM's use_tqdm is accepted (no progress bar is drawn); lora_request
        must be None (no LoRA adapters)."""
        if lora_request is not None:
            raise ValueError("lora_request: LoRA adapters are not supported")
        if self._proc is not None:
            return self._proc.call("generate", prompts, sampling_params, prompt_token_ids, images)  # type: ignore[no-any-return]
        engine = self._engine()
        given = parse_prompts(prompts, prompt_token_ids, self.tokenizer)
        if self._mm_limits:
            check_image_counts(self._mm_limits, [len(p.images or ()) for p in given])
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(given)
        if len(params) != len(given):
            raise ValueError(f"{len(params)} sampling_params for {len(given)} prompts")
        imgs = images if images is not None else [()] * len(given)
        if any(p.images is not None for p in given):  # vLLM's multi_modal_data: placed here, as the router places them
            if images is not None:
                raise ValueError("give images either as images= or in the prompts' multi_modal_data, not both")
            given, imgs = expand_prompts(self.config.model.path, self.config.model.vision, given)
        if len(imgs) != len(given):
            raise ValueError(f"{len(imgs)} image lists for {len(given)} prompts")
        rows = each_completion(params)  # vLLM's n: a request per completion
        given, imgs, params = [given[i] for i, _ in rows], [imgs[i] for i, _ in rows], [sp for _, sp in rows]
        watches: dict[int, TextWatch] = {}
        for k, ((i, sp), p) in enumerate(zip(rows, given)):  # refuse the batch before any of it runs
            try:
                engine.validate(p.token_ids, sp)
                if sp.stop:
                    if self.tokenizer is None:
                        raise ValueError("stop strings need the checkpoint's tokenizer (it has no tokenizer.json)")
                    watches[k] = TextWatch(self.tokenizer, sp)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        rids: list[str] = []
        done: dict[str, RequestOutput] = {}
        logprobs: dict[str, list] = {}
        prompt_logprobs: dict[str, list] = {}
        stopped: dict[str, Stopped] = {}
        watch: dict[str, TextWatch] = {}
        try:
            for k, ((i, sp), p, im) in enumerate(zip(rows, given, imgs)):
                try:
                    rids.append(engine.add_request(p.token_ids, sp, images=tuple(im)))
                except ValueError as e:
                    raise ValueError(f"prompt {i}: {e}") from None
                logprobs[rids[-1]] = []
                if k in watches:
                    watch[rids[-1]] = watches[k]
            while len(done) < len(rids):
                self._check_interrupt()
                for out in engine.step():
                    rid = out.request_id
                    if rid not in logprobs or rid in done:  # not this call's (or ended by a stop string)
                        continue
                    logprobs[rid] += out.logprobs or []
                    if out.prompt_logprobs is not None:
                        prompt_logprobs[rid] = out.prompt_logprobs
                    hit = watch[rid].push(out.new_token_ids) if rid in watch else None
                    if hit is not None:
                        if not out.finished:
                            engine.abort(rid)
                        out.output_token_ids = list(out.output_token_ids[: hit.keep])
                        out.finished, out.finish_reason = True, "stop"
                        logprobs[rid] = logprobs[rid][: hit.keep]
                        stopped[rid] = hit
                    if out.finished:
                        done[rid] = out
        except BaseException:
            self._abort(r for r in rids if r not in done)
            raise
        outs = [
            finish(done[r], sp, p.text, logprobs[r], prompt_logprobs.get(r), self.tokenizer, stopped.get(r))
            for r, sp, p in zip(rids, params, given)
        ]
        return by_prompt(outs, rows)

    def chat(
        self,
        messages: Any,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: Any = True,
        lora_request: Any = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's chat: one conversation (a list of {"role", "content"} dicts) or a list of them,
        each rendered by the checkpoint's chat template (transformers' apply_chat_template, with
        tools, the switches and chat_template_kwargs such as {"enable_thinking": False}) and
        generated as `generate` does; each output's `prompt` is the rendered text."""
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise ValueError(
                f"chat_template_content_format must be auto, string or openai (got {chat_template_content_format!r})"
            )
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("chat needs the checkpoint's tokenizer and chat template (it has no tokenizer.json)")
        texts = render_chat(
            tok,
            conversations(messages),
            tools=tools,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
        )
        return self.generate(texts, sampling_params, lora_request=lora_request)

    def get_tokenizer(self) -> Any:
        """The checkpoint's tokenizer as transformers loads it (what vLLM's get_tokenizer returns:
        encode, decode, apply_chat_template, eos_token_id), or None when it has none."""
        if self._hf_tokenizer is None and Tokenizer.exists(self._model_path):
            from transformers import AutoTokenizer  # noqa: PLC0415 (loaded on first use)

            self._hf_tokenizer = AutoTokenizer.from_pretrained(self._model_path)
        return self._hf_tokenizer

    def compute_logits(self, prompt_token_ids: list[list[int]]) -> list[torch.Tensor]:
        """Next-token logits [vocab] (float32) after each prompt, through the serving path."""
        if self._proc is not None:
            return self._proc.call("compute_logits", prompt_token_ids)  # type: ignore[no-any-return]
        engine = self._engine()
        sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        rids: list[str] = []
        try:
            for p in parse_prompts(None, prompt_token_ids, None):
                rids.append(engine.add_request(p.token_ids, sp, want_logits=True))
            reqs = {r: engine.requests[r] for r in rids}
            while any(r.logits is None for r in reqs.values()):
                self._check_interrupt()
                engine.step()
        except BaseException:
            self._abort(rids)
            raise
        return [reqs[r].logits for r in rids]

    def _check_interrupt(self) -> None:
        """Between engine steps: raise Interrupted when the caller gave the call up (the engine
        process's parent sent another message: engine/llm_process.py)."""
        if self.interrupted is not None and self.interrupted():
            raise Interrupted

    def _abort(self, rids: Iterable[str]) -> None:
        """End a call's unfinished requests (it was interrupted or failed), so that they neither
        hold memory nor hand their outputs to a later call."""
        assert self.engine is not None
        for r in list(rids):
            try:
                self.engine.abort(r)
            except Exception:  # noqa: BLE001 (the call's own error is the one to raise)
                log.exception("aborting %s after a failed call", r)

    def close(self) -> None:
        if self._proc is not None:
            self._proc.close()
        elif getattr(self, "engine", None) is not None:
            engine, self.engine = self.engine, None
            assert engine is not None
            engine.close()

    def shutdown(self) -> None:
        """vLLM's name for close()."""
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def warn_openmp_policy(device: str) -> str | None:
    """On the CPU, when torch was imported before the engine without OMP_WAIT_POLICY set, log
    (and return) how to get the engine's speed back: OpenMP's idle threads then spin on the cores
    the engine's C ops need (docs/ARCHITECTURE.md, the OMP_WAIT_POLICY paragraph)."""
    import engine

    if not str(device).startswith("cpu") or not engine.TORCH_LOADED_FIRST:
        return None
    msg = (
        "torch was imported before the engine, so OpenMP's idle threads spin and the CPU path runs "
        "up to 1.6x slower; set OMP_WAIT_POLICY=PASSIVE in the environment, or import engine before torch"
    )
    log.warning(msg)
    return msg
