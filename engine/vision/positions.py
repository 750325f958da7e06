"""Qwen3.5's multimodal rotary positions (M-RoPE) of a prompt with images, computed once where
the prompt is prefilled, and the per-request offset every later token's position takes.

Each token has a (t, h, w) position. A text token's three are equal: the running position p,
which then advances by one. An image whose merged grid is T x H x W (the processor's grid with
h and w divided by the merge size) at running position p gives its token at (i, r, c) the
position (p + i, p + r, p + c), tokens in raster order; p then advances by max(H, W) (not by
T * H * W: an image takes fewer positions than tokens). The prompt's last position + 1 minus its
length is `rope_delta` (<= 0): token n >= len(prompt) (the reply, a recomputed reply) has
position n + rope_delta on all three axes. A prompt without images has delta 0 and the plain
1-D positions; the text rotary path is then unchanged.

The rotary frequencies are split between the axes as the checkpoint's `mrope_section` (t, h, w)
says, interleaved (Qwen3.5): frequency j < rotary_dim / 2 turns with h when j % 3 == 1 and
j < 3 * section[1], with w when j % 3 == 2 and j < 3 * section[2], with t otherwise
(engine/model/rotary.py `mrope_axes`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.vision.inputs import ImageInput


def mrope_positions(num_tokens: int, images: Sequence[ImageInput], merge: int) -> tuple[torch.Tensor, int]:
    """([3, num_tokens] int64 positions, rope_delta) of a prompt of `num_tokens` tokens whose
    images (in prompt order, not overlapping) start at their `offset`s."""
    out = torch.empty(3, num_tokens, dtype=torch.int64)
    pos = 0  # the running position
    i = 0  # the next token
    for img in images:
        n_text = img.offset - i
        out[:, i : img.offset] = torch.arange(pos, pos + n_text)
        pos += n_text
        t, h, w = img.grid_thw[0], img.grid_thw[1] // merge, img.grid_thw[2] // merge
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        n = t * h * w
        out[:, img.offset : img.offset + n] = torch.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)]) + pos
        pos += max(h, w)
        i = img.offset + n
    out[:, i:] = torch.arange(pos, pos + num_tokens - i)
    pos += num_tokens - i
    return out, pos - num_tokens


def check_images(prompt: Sequence[int], images: Sequence[ImageInput], image_token_id: int, merge: int) -> None:
    """Refuse images that do not sit on their placeholders: each image's `num_tokens(merge)`
    tokens from its offset must be <|image_pad|>, the images in prompt order without overlap, and
    every <|image_pad|> of the prompt covered by one (ValueError naming the image)."""
    covered = 0
    end = 0
    for k, img in enumerate(images):
        t, h, w = img.grid_thw
        if min(img.grid_thw) < 1 or h % merge or w % merge:
            raise ValueError(f"image {k}: grid_thw {list(img.grid_thw)} is not a positive grid divisible by {merge}")
        n = img.num_tokens(merge)
        if img.offset < end:
            raise ValueError(f"image {k}: offset {img.offset} overlaps the image before it (ends at {end})")
        if img.offset + n > len(prompt):
            raise ValueError(
                f"image {k}: {n} placeholder tokens from offset {img.offset} run past the prompt ({len(prompt)})"
            )
        if any(tok != image_token_id for tok in prompt[img.offset : img.offset + n]):
            raise ValueError(f"image {k}: the prompt has no run of {n} <|image_pad|> tokens at offset {img.offset}")
        if len(img.pixel_hash) != 32:
            raise ValueError(f"image {k}: pixel_hash must be 32 bytes (SHA-256), got {len(img.pixel_hash)}")
        covered += n
        end = img.offset + n
    pads = sum(1 for tok in prompt if tok == image_token_id)
    if pads != covered:
        raise ValueError(f"the prompt has {pads} <|image_pad|> tokens but its {len(images)} image(s) cover {covered}")
