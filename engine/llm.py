"""LLM: the offline entry point. `LLM(path).generate(...)` runs a batch to completion."""

from __future__ import annotations

import logging

import torch

from engine.cache.allocator import Capacity
from engine.config import EngineArgs
from engine.core import EngineCore
from engine.llm_process import EngineProcess
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from engine.vision.inputs import ImageInput

log = logging.getLogger("pdserve.llm")


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
    ):
        """engine_process: run the engine in a process of its own (engine/llm_process.py); None
        (default): on the CPU when torch was imported before the engine, whose OpenMP threads would
        otherwise spin on the engine's cores; in this process otherwise. model: a checkpoint
        directory, or a Hugging Face repo id (engine/hub.py)."""
        from engine.hub import resolve

        model = resolve(model)
        kwargs = {k: v for k, v in locals().items() if k not in ("self", "engine_process", "resolve")}
        if engine_process is None:
            import engine

            engine_process = str(device).startswith("cpu") and engine.TORCH_LOADED_FIRST
        self._proc: EngineProcess | None = None
        if engine_process:
            self._proc = EngineProcess(kwargs)
            self.engine: EngineCore | None = None
            return
        self.config = EngineArgs(
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
        ).engine_config()
        self.tokenizer = Tokenizer(model) if Tokenizer.exists(model) else None
        self.engine = EngineCore(self.config)
        warn_openmp_policy(device)

    def capacity(self) -> Capacity:
        if self._proc is not None:
            return self._proc.call("capacity")  # type: ignore[no-any-return]
        assert self.engine is not None
        return self.engine.capacity

    def _prompts(self, prompts, prompt_token_ids) -> list[list[int]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompts=[str, ...] or prompt_token_ids=[[int, ...], ...]")
        if prompt_token_ids is not None:
            return [list(p) for p in prompt_token_ids]
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer.json: pass prompt_token_ids")
        if isinstance(prompts, str):
            prompts = [prompts]
        return [self.tokenizer.encode(p) for p in prompts]

    def generate(
        self,
        prompts: list[str] | str | None = None,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        prompt_token_ids: list[list[int]] | None = None,
        images: list[tuple[ImageInput, ...]] | None = None,
    ) -> list[RequestOutput]:
        """images: per prompt, its images on their <|image_pad|> runs (docs/images.md)."""
        if self._proc is not None:
            return self._proc.call("generate", prompts, sampling_params, prompt_token_ids, images)  # type: ignore[no-any-return]
        assert self.engine is not None
        ids = self._prompts(prompts, prompt_token_ids)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(ids)
        if len(params) != len(ids):
            raise ValueError(f"{len(params)} sampling_params for {len(ids)} prompts")
        imgs = images if images is not None else [()] * len(ids)
        if len(imgs) != len(ids):
            raise ValueError(f"{len(imgs)} image lists for {len(ids)} prompts")
        for i, (p, sp) in enumerate(zip(ids, params)):  # refuse the batch before any of it runs
            try:
                self.engine.validate(p, sp)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        rids = []
        for i, (p, sp, im) in enumerate(zip(ids, params, imgs)):
            try:
                rids.append(self.engine.add_request(p, sp, images=tuple(im)))
            except ValueError as e:
                for r in rids:
                    self.engine.abort(r)
                raise ValueError(f"prompt {i}: {e}") from None
        done: dict[str, RequestOutput] = {}
        logprobs: dict[str, list] = {r: [] for r in rids}
        prompt_logprobs: dict[str, list] = {}
        while len(done) < len(rids):
            for out in self.engine.step():
                logprobs[out.request_id] += out.logprobs or []
                if out.prompt_logprobs is not None:
                    prompt_logprobs[out.request_id] = out.prompt_logprobs
                if out.finished:
                    done[out.request_id] = out
        outs = [done[r] for r in rids]
        for o, sp in zip(outs, params):  # the whole request's, not the last step's
            o.logprobs = logprobs[o.request_id] if sp.logprobs is not None else None
            o.prompt_logprobs = prompt_logprobs.get(o.request_id) if sp.prompt_logprobs is not None else None
        if self.tokenizer is not None:
            for o in outs:
                o.text = self.tokenizer.decode(o.output_token_ids)
        return outs

    def compute_logits(self, prompt_token_ids: list[list[int]]) -> list[torch.Tensor]:
        """Next-token logits [vocab] (float32) after each prompt, through the serving path."""
        if self._proc is not None:
            return self._proc.call("compute_logits", prompt_token_ids)  # type: ignore[no-any-return]
        assert self.engine is not None
        sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        rids = [self.engine.add_request(list(p), sp, want_logits=True) for p in prompt_token_ids]
        reqs = {r: self.engine.requests[r] for r in rids}
        while any(r.logits is None for r in reqs.values()):
            self.engine.step()
        return [reqs[r].logits for r in rids]

    def close(self) -> None:
        if self._proc is not None:
            self._proc.close()
        elif getattr(self, "engine", None) is not None:
            self.engine.close()

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
