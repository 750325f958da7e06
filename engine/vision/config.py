"""The vision tower's sizes and the multimodal rotary layout, read from a vision-language
checkpoint's config.json (`vision_config`, the text config's `rope_parameters`) without torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int  # the merger's output: the text model's hidden size
    num_position_embeddings: int  # a square learned grid, resampled to each image's patch grid
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    image_token_id: int = -1  # <|image_pad|>
    video_token_id: int = -1
    vision_start_token_id: int = -1
    mrope_section: tuple[int, int, int] = (11, 11, 10)  # text rotary frequencies of (t, h, w), interleaved

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        side = int(self.num_position_embeddings**0.5)
        if side * side != self.num_position_embeddings:
            raise ValueError(f"vision num_position_embeddings {self.num_position_embeddings} is not a square")
        if self.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"unsupported vision hidden_act {self.hidden_act!r}; supported: gelu_pytorch_tanh, gelu")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid_side(self) -> int:
        return int(self.num_position_embeddings**0.5)

    @property
    def patch_dim(self) -> int:
        """Values per patch as the processor flattens it: channels x temporal x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @classmethod
    def from_raw(cls, raw: dict, text: dict) -> VisionConfig | None:
        """From a wrapper config.json (`raw`) and its text config; None without a vision tower."""
        v = raw.get("vision_config")
        if not v:
            return None
        rope = text.get("rope_parameters") or {}
        if rope.get("mrope_interleaved") is False:
            raise ValueError("blocked (non-interleaved) mrope_section is not supported; Qwen3.5 interleaves it")
        section = tuple(rope.get("mrope_section") or (11, 11, 10))
        if len(section) != 3:
            raise ValueError(f"mrope_section must have 3 entries (t, h, w), got {list(section)}")
        vrope = v.get("rope_parameters") or {}
        return cls(
            depth=v["depth"],
            hidden_size=v["hidden_size"],
            num_heads=v["num_heads"],
            intermediate_size=v["intermediate_size"],
            out_hidden_size=v["out_hidden_size"],
            num_position_embeddings=v["num_position_embeddings"],
            patch_size=v.get("patch_size", 16),
            temporal_patch_size=v.get("temporal_patch_size", 2),
            spatial_merge_size=v.get("spatial_merge_size", 2),
            in_channels=v.get("in_channels", 3),
            hidden_act=v.get("hidden_act", "gelu_pytorch_tanh"),
            rope_theta=float(vrope.get("rope_theta", 10000.0)),
            image_token_id=raw.get("image_token_id", -1),
            video_token_id=raw.get("video_token_id", -1),
            vision_start_token_id=raw.get("vision_start_token_id", -1),
            mrope_section=(int(section[0]), int(section[1]), int(section[2])),
        )
