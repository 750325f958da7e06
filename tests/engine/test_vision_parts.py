"""The image path's parts against transformers on the same inputs: the vision encoder against
its vision model, the M-RoPE positions against get_rope_index, the rotary tables against its
text rotary embedding."""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.model.rotary import Rotary, mrope_axes, mrope_cos_sin
from engine.vision.encoder import VisionEncoder
from engine.vision.inputs import decode_rgb
from engine.vision.positions import check_images, mrope_positions
from engine.vision.weights import load_vision_weights
from tests.helpers import vl_ckpt as vc


@pytest.fixture(scope="module")
def vl_dense(tmp_path_factory):
    return vc.make(tmp_path_factory.mktemp("vl") / "ckpt", vc.SPEC_VL["qwen3_5"])


def _prompt(path, sizes, text=(5, 6, 7)):
    """Text, then per image <|vision_start|><|image_pad|><|vision_end|> and more text."""
    s, e, pad = (vc.token(path, n) for n in ("vision_start", "vision_end", "image"))
    ids = list(text)
    for k in range(len(sizes)):
        ids += [s, pad, e, 30 + k, 31 + k]
    return vc.expand(path, ids, [vc.png(w, h, k) for k, (w, h) in enumerate(sizes)])


def test_encoder_matches_transformers(vl_dense):
    cfg = ModelConfig.from_dir(vl_dense)
    assert cfg.vision is not None
    enc = VisionEncoder(cfg.vision, load_vision_weights(vl_dense, cfg.vision, torch.float32), torch.float32)
    imgs = [decode_rgb(vc.png(w, h, k)) for k, (w, h) in enumerate([(70, 50), (200, 120), (64, 256)])]
    got = vc.processor(vl_dense)(images=imgs, return_tensors="pt")
    with torch.inference_mode():
        ref = vc.hf_model(vl_dense).model.get_image_features(got["pixel_values"], got["image_grid_thw"]).pooler_output
    off = 0
    for k, g in enumerate(got["image_grid_thw"].tolist()):
        n = g[0] * g[1] * g[2]
        out = enc.encode(got["pixel_values"][off : off + n], tuple(g))
        off += n
        assert out.shape == ref[k].shape
        err = ((out - ref[k]).abs().max() / ref[k].abs().max()).item()
        assert err < 1e-5, f"image {k} grid {g}: rel err {err:.2e}"


@pytest.mark.parametrize("sizes", [[], [(70, 50)], [(200, 120), (64, 256)], [(256, 64), (90, 90), (300, 40)]])
def test_positions_match_get_rope_index(vl_dense, sizes):
    ids, images = _prompt(vl_dense, sizes)
    check_images(ids, images, vc.token(vl_dense, "image"), 2)
    pos, delta = mrope_positions(len(ids), images, 2)
    kw = vc.hf_inputs(vl_dense, ids, images)
    ref, ref_delta = vc.hf_model(vl_dense).model.get_rope_index(
        kw["input_ids"], kw["mm_token_type_ids"], kw.get("image_grid_thw")
    )
    assert torch.equal(pos, ref[:, 0])
    assert delta == int(ref_delta[0, 0])


def test_mrope_rotary_matches_transformers(vl_dense):
    cfg = ModelConfig.from_dir(vl_dense)
    ids, images = _prompt(vl_dense, [(200, 120), (64, 256)])
    pos, _ = mrope_positions(len(ids), images, 2)
    rot = Rotary(cfg.rotary_dim, cfg.rope_theta, 512, torch.float32)
    cos, sin = mrope_cos_sin(rot, pos, mrope_axes(cfg.rotary_dim, cfg.vision.mrope_section))
    emb = vc.hf_model(vl_dense).model.language_model.rotary_emb
    rcos, rsin = emb(torch.zeros(1, dtype=torch.float32), pos[:, None, :])
    assert torch.allclose(cos[:, 0], rcos[0], atol=1e-6) and torch.allclose(sin[:, 0], rsin[0], atol=1e-6)


def test_images_must_sit_on_their_placeholders(vl_dense):
    ids, images = _prompt(vl_dense, [(70, 50)])
    pad = vc.token(vl_dense, "image")
    img = images[0]
    with pytest.raises(ValueError, match="no run of 4 <|image_pad|> tokens at offset 5"):
        check_images(ids, [type(img)(img.data, img.pixel_hash, img.offset + 1, img.grid_thw)], pad, 2)
    with pytest.raises(ValueError, match="has 4 <|image_pad|> tokens but its 0 image"):
        check_images(ids, [], pad, 2)
    with pytest.raises(ValueError, match="not a positive grid"):
        check_images(ids, [type(img)(img.data, img.pixel_hash, img.offset, (1, 3, 4))], pad, 2)


@pytest.mark.parametrize("mode", ["RGBA", "LA"])
def test_transparent_images_are_seen_as_the_processor_sees_them(vl_dense, mode):
    """An image with transparency (hidden pixels black, as encoders store them): decoded, its pixel
    values equal what the checkpoint's processor makes of the image itself (composited onto white)."""
    import io

    import numpy as np
    from PIL import Image

    rgb = Image.open(io.BytesIO(vc.png(40, 30, 3))).convert("RGB")
    alpha = np.zeros((30, 40), np.uint8)
    alpha[8:22, 10:30] = 255  # a visible rectangle; around it fully transparent
    alpha[8:22, 10:14] = 128  # and a half-transparent band
    img = rgb.copy()
    img.putalpha(Image.fromarray(alpha))
    arr = np.array(img)
    arr[alpha == 0, :3] = 0  # what a transparent pixel hides
    img = Image.fromarray(arr, "RGBA")
    if mode == "LA":
        img = img.convert("LA")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    proc = vc.processor(vl_dense)

    def pixels(im) -> torch.Tensor:  # a copy: the processor may hand back its own buffer
        return proc(images=[im], return_tensors="pt")["pixel_values"].clone()

    got = pixels(decode_rgb(buf.getvalue()))
    want = pixels(Image.open(io.BytesIO(buf.getvalue())))
    dropped = pixels(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))  # the alpha thrown away
    assert torch.equal(got, want) and not torch.equal(got, dropped)
