"""Tiny vision-language checkpoints (engine/tiny_model.py, `vision=True`), test images, the
processed inputs transformers' own image processor makes of them, and transformers' greedy
`generate` on those inputs: the reference the engine's image path is compared with."""

from __future__ import annotations

import functools
import io

import torch

from engine.tiny_model import TinyModelSpec, make_tiny_model
from engine.vision.inputs import ImageInput, decode_rgb, hash_pixels

SPEC_VL = {
    "qwen3_5": TinyModelSpec(arch="qwen3_5", layers=4, vision=True, seed=11),
    "qwen3_5_moe": TinyModelSpec(arch="qwen3_5_moe", layers=4, vision=True, seed=12),
}


def make(path, spec: TinyModelSpec) -> str:
    return str(make_tiny_model(path, spec))


def png(width: int, height: int, seed: int = 0) -> bytes:
    """A PNG of smooth random colours (gradients plus noise), so the resize matters."""
    import numpy as np
    from PIL import Image

    g = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([xx * 255 / max(1, width - 1), yy * 255 / max(1, height - 1), (xx + yy) % 256], -1)
    px = np.clip(base + g.normal(0, 40, (height, width, 3)), 0, 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, format="PNG")
    return buf.getvalue()


@functools.lru_cache(maxsize=8)
def processor(path: str):
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(path)


@functools.lru_cache(maxsize=8)
def _config(path: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def _processed(path: str, images: list, kwargs: dict | None) -> dict:
    """transformers' image processor on `images` (PIL), with the request's keyword arguments."""
    import warnings

    with warnings.catch_warnings():  # min_pixels / max_pixels at call time are deprecated in transformers 5
        warnings.simplefilter("ignore", FutureWarning)
        return processor(path)(images=images, return_tensors="pt", **(kwargs or {}))


def expand(
    path: str, ids: list[int], images: list[bytes], kwargs: dict | None = None
) -> tuple[list[int], list[ImageInput]]:
    """`ids` with one <|image_pad|> per image (in order) replaced by the image's placeholder
    tokens, and the images as the router hands them over (hash, offset, grid from the processor,
    called with `kwargs`: a request's mm_processor_kwargs, whose hash and bounds are not filled in)."""
    cfg = _config(path)
    merge = cfg.vision_config.spatial_merge_size
    out: list[int] = []
    inputs: list[ImageInput] = []
    it = iter(images)
    for t in ids:
        if t != cfg.image_token_id:
            out.append(t)
            continue
        data = next(it)
        img = decode_rgb(data)
        grid = tuple(int(x) for x in _processed(path, [img], kwargs)["image_grid_thw"][0])
        image = ImageInput(data, hash_pixels(img), len(out), grid)  # type: ignore[arg-type]
        inputs.append(image)
        out += [cfg.image_token_id] * image.num_tokens(merge)
    assert next(it, None) is None, "more images than <|image_pad|> tokens"
    return out, inputs


def hf_inputs(path: str, ids: list[int], images: list[ImageInput], kwargs: dict | None = None) -> dict:
    """transformers' model inputs for an expanded prompt: pixel values from its image processor
    (called with `kwargs`), grids, and the token types its M-RoPE index needs."""
    cfg = _config(path)
    kw: dict = {"input_ids": torch.tensor([ids])}
    kw["mm_token_type_ids"] = (kw["input_ids"] == cfg.image_token_id).int()
    if images:
        got = _processed(path, [decode_rgb(i.data) for i in images], kwargs)
        kw["pixel_values"] = got["pixel_values"]
        kw["image_grid_thw"] = got["image_grid_thw"]
    return kw


@functools.lru_cache(maxsize=4)
def hf_model(path: str, device: str = "cpu"):
    import transformers

    arch = _config(path).architectures[0]
    return getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval().to(device)


def hf_greedy(
    path: str,
    ids: list[int],
    images: list[ImageInput],
    new_tokens: int,
    device: str = "cpu",
    kwargs: dict | None = None,
) -> list[int]:
    kw = {k: v.to(device) for k, v in hf_inputs(path, ids, images, kwargs).items()}
    with torch.inference_mode():
        out = hf_model(path, device).generate(
            **kw, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens
        )
    return out[0, len(ids) :].tolist()


def token(path: str, name: str) -> int:
    return int(getattr(_config(path), f"{name}_token_id"))


def chat_text(path: str, messages: list[dict]) -> str:
    """The checkpoint's chat template over `messages`: one <|vision_start|><|image_pad|><|vision_end|>
    per image part (what a client sends with its images; the router expands each)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return str(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False))


def chat_ids(path: str, messages: list[dict]) -> list[int]:
    """`chat_text` tokenized."""
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(path).encode(chat_text(path, messages), add_special_tokens=False))


def chat(path: str, messages: list[dict], images: list[bytes]) -> tuple[list[int], list[ImageInput]]:
    """`chat_ids`, then `expand`: the prompt and images the router hands a node."""
    return expand(path, chat_ids(path, messages), images)


def user(*parts: str | None) -> dict:
    """A user turn: strings are text parts, None an image part."""
    return {"role": "user", "content": [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]}


CASES = {  # name -> (messages, image sizes (width, height))
    "one_image": ([user(None, "What is in this picture?")], [(120, 90)]),
    "two_sizes": ([user("Compare", None, "with", None)], [(200, 120), (64, 180)]),
    "earlier_turn": (
        [
            user(None, "Describe it."),
            {"role": "assistant", "content": "A small model wanted to generate text."},
            user("And the quick brown fox?"),
        ],
        [(90, 140)],
    ),
    "text_only": ([user("Hello world! How are you today?")], []),
}


def case_images(name: str, seed: int = 0) -> list[bytes]:
    return [png(w, h, seed + k) for k, (w, h) in enumerate(CASES[name][1])]


def case(path: str, name: str, seed: int = 0) -> tuple[list[int], list[ImageInput]]:
    return chat(path, CASES[name][0], case_images(name, seed))
