"""Qwen3.5's vision encoder in PyTorch: pixel patches -> one embedding per merged 2 x 2 patch
block, in the text model's hidden size (docs/images.md "The encoder").

Per image (a t x h x w grid of patches, listed by the processor in merge-block order):
patch embedding (the 3-D convolution, whose stride equals its kernel, as one matrix product),
plus the learned square position grid resampled bilinearly (corners aligned) to h x w; then
`depth` pre-norm blocks (LayerNorm, multi-head attention with a 2-D rotary embedding of each
patch's (row, column), LayerNorm, MLP), attention within each frame only (never across images);
then the merger: LayerNorm, the 4 patches of each merge block side by side, Linear, GELU, Linear.
Under tensor parallelism every rank runs the whole encoder on replicated weights (the tower is
small next to the text model), so every rank has the same embeddings with no communication."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.vision.config import VisionConfig


@dataclass
class VisionBlock:
    norm1: tuple[torch.Tensor, torch.Tensor]  # LayerNorm (weight, bias)
    qkv: tuple[torch.Tensor, torch.Tensor]  # Linear (weight [3 D, D], bias)
    proj: tuple[torch.Tensor, torch.Tensor]
    norm2: tuple[torch.Tensor, torch.Tensor]
    fc1: tuple[torch.Tensor, torch.Tensor]
    fc2: tuple[torch.Tensor, torch.Tensor]


def merge_block_order(h: int, w: int, merge: int) -> torch.Tensor:
    """Raster index (row * w + col) of each patch in the processor's order: merge blocks in
    raster order, the merge x merge patches of a block in raster order inside it."""
    idx = torch.arange(h * w).view(h // merge, merge, w // merge, merge)
    return idx.permute(0, 2, 1, 3).reshape(-1)


class VisionEncoder:
    def __init__(self, cfg: VisionConfig, weights: dict, dtype: torch.dtype, device="cpu"):
        """weights: `load_vision_weights`' dict (engine/vision/weights.py)."""
        self.cfg, self.dtype, self.device = cfg, dtype, device
        pw = weights["patch_embed.proj.weight"]
        self.patch_w = pw.reshape(pw.shape[0], -1)  # [D, C*T*P*P]: the conv over one patch
        self.patch_b = weights["patch_embed.proj.bias"]
        self.pos_grid = weights["pos_embed.weight"]  # [side * side, D]
        self.blocks = [
            VisionBlock(
                *(
                    (weights[f"blocks.{i}.{n}.weight"], weights[f"blocks.{i}.{n}.bias"])
                    for n in ("norm1", "attn.qkv", "attn.proj", "norm2", "mlp.linear_fc1", "mlp.linear_fc2")
                )
            )
            for i in range(cfg.depth)
        ]
        self.merger_norm = (weights["merger.norm.weight"], weights["merger.norm.bias"])
        self.merger_fc1 = (weights["merger.linear_fc1.weight"], weights["merger.linear_fc1.bias"])
        self.merger_fc2 = (weights["merger.linear_fc2.weight"], weights["merger.linear_fc2.bias"])
        hd = cfg.head_dim
        quarter = hd // 2  # each of row and column rotates hd / 2 dims: hd / 4 frequencies
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter))
        self.act = "tanh" if cfg.hidden_act == "gelu_pytorch_tanh" else "none"

    def _positions(self, t: int, h: int, w: int) -> torch.Tensor:
        """[t*h*w, D] the learned grid resampled to h x w (bilinear, corners aligned), in the
        processor's patch order, for each of the t frames."""
        side, d = self.cfg.grid_side, self.cfg.hidden_size
        grid = self.pos_grid.float().T.reshape(1, d, side, side)
        res = F.interpolate(grid, size=(h, w), mode="bilinear", align_corners=True)[0]  # [D, h, w]
        flat = res.reshape(d, h * w).T[merge_block_order(h, w, self.cfg.spatial_merge_size)]
        return flat.repeat(t, 1).to(self.dtype)

    def _rotary(self, t: int, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [t*h*w, 1, head_dim] float32: the first half of each head's frequencies turn
        with the patch's row, the second half with its column (rotate-half form)."""
        order = merge_block_order(h, w, self.cfg.spatial_merge_size)
        rows, cols = (order // w).float(), (order % w).float()
        ang = torch.cat([rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq], dim=-1)
        ang = torch.cat([ang, ang], dim=-1).repeat(t, 1)
        return ang.cos()[:, None, :], ang.sin()[:, None, :]

    def _attention(self, b: VisionBlock, x: torch.Tensor, cos, sin, frame: int) -> torch.Tensor:
        n, hd = x.shape[0], self.cfg.head_dim
        q, k, v = F.linear(x, *b.qkv).view(n, 3, self.cfg.num_heads, hd).unbind(1)  # [n, H, hd] each
        q, k = (_rotate(z.float(), cos, sin).to(x.dtype) for z in (q, k))
        outs = []
        for s in range(0, n, frame):  # attention within a frame
            qs, ks, vs = (z[s : s + frame].transpose(0, 1) for z in (q, k, v))  # [H, f, hd]
            outs.append(F.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1).reshape(-1, self.cfg.hidden_size))
        return F.linear(torch.cat(outs), *b.proj)

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        """pixels [t*h*w, patch_dim] (the processor's pixel_values of one image) -> [t*h*w / merge^2,
        out_hidden_size] in the model's dtype."""
        t, h, w = grid_thw
        if pixels.shape != (t * h * w, self.cfg.patch_dim):
            raise ValueError(
                f"pixel values {list(pixels.shape)} do not match grid {grid_thw} (patch {self.cfg.patch_dim})"
            )
        d, eps = self.cfg.hidden_size, 1e-6
        x = F.linear(pixels.to(self.device, self.dtype), self.patch_w, self.patch_b)
        x = x + self._positions(t, h, w).to(self.device)
        cos, sin = (c.to(self.device) for c in self._rotary(t, h, w))
        for b in self.blocks:
            x = x + self._attention(b, F.layer_norm(x, (d,), *b.norm1, eps), cos, sin, h * w)
            y = F.gelu(F.linear(F.layer_norm(x, (d,), *b.norm2, eps), *b.fc1), approximate=self.act)
            x = x + F.linear(y, *b.fc2)
        m = self.cfg.spatial_merge_size**2
        x = F.layer_norm(x, (d,), *self.merger_norm, eps).reshape(-1, d * m)
        return F.linear(F.gelu(F.linear(x, *self.merger_fc1)), *self.merger_fc2)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin
