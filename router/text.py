"""Tokenization and detokenization off the router's event loop: `TextPool` runs long texts on a
small thread pool (the tokenizer's batch calls release the GIL, so the loop keeps serving while a
long prompt is encoded) and short ones inline, where a thread hop would cost more than the work.
The caller checks a prompt's length (router/http_limits.py, `prompt_chars_limit`) before it gets
here: nothing bounds the time one encode takes but its length."""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

from engine.tokenizer import Tokenizer

# Texts up to this many characters (token lists up to this many ids) are done on the loop: about
# a millisecond of tokenizer time, less than a hop to a thread and back under load.
INLINE_CHARS = 2048
INLINE_IDS = 512


def default_workers() -> int:
    """One thread per core the process may run on, at least 2 (a long encode must not queue a short
    one behind it), at most 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(2, min(8, cores))


class TextPool:
    """The router's tokenizer calls, each awaited on the loop; `close()` ends the threads."""

    def __init__(self, tokenizer: Tokenizer, workers: int = 0) -> None:
        self.tok = tokenizer
        self.workers = workers or default_workers()
        self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="tokenize")

    async def encode(self, text: str) -> list[int]:
        if len(text) <= INLINE_CHARS:
            return self.tok.encode(text)
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.tok.encode_released, text)

    async def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if len(ids) <= INLINE_IDS:
            return self.tok.decode(ids, skip_special_tokens)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.tok.decode_released, ids, skip_special_tokens)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
