"""Images through the engine, float32 greedy, token for token against transformers' `generate`
on the same processed inputs (tests/helpers/vl_ckpt.py): one image, two of different sizes in
one message, an image in an earlier turn, text only; dense and MoE; chunked prefill splitting
images; TP 2; preemption; the prefix cache with different and equal images."""

from __future__ import annotations

import dataclasses

import pytest

from engine import LLM, SamplingParams
from engine.vision.embedder import image_stats
from tests.helpers import vl_ckpt as vc

NEW = 16
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
ARCHS = ["qwen3_5", "qwen3_5_moe"]


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """vl(arch) -> (checkpoint, {case: (prompt, images, transformers' tokens)})."""
    made = {}

    def get(arch):
        if arch not in made:
            path = vc.make(tmp_path_factory.mktemp(arch) / "ckpt", vc.SPEC_VL[arch])
            cases = {}
            for name in vc.CASES:
                ids, imgs = vc.case(path, name)
                cases[name] = (ids, imgs, vc.hf_greedy(path, ids, imgs, NEW))
            made[arch] = (path, cases)
        return made[arch]

    return get


def _run(llm, cases):
    outs = llm.generate(
        prompt_token_ids=[c[0] for c in cases.values()], images=[c[1] for c in cases.values()], sampling_params=GREEDY
    )
    for name, o, (ids, _, ref) in zip(cases, outs, cases.values()):
        assert o.output_token_ids == ref, f"{name} ({len(ids)} tokens) diverges from transformers"
    assert llm.engine.blocks.num_free == llm.capacity().num_blocks
    return outs


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_transformers_chunked(vl, arch):
    path, cases = vl(arch)
    # 32-token chunks: the two-image prompt's first image (24 tokens from 11) spans two chunks
    with LLM(path, dtype="float32", max_num_batched_tokens=32) as llm:
        _run(llm, cases)
        (stats,) = llm.engine.executor.call_all(image_stats)
        assert stats["images"] == 4  # each image encoded once, whatever the chunks


def test_matches_transformers_tp2(vl):
    """Every rank runs the whole encoder on replicated weights; the text model is sharded (MoE:
    each expert's intermediate split over the ranks)."""
    path, cases = vl("qwen3_5_moe")
    with LLM(path, dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=48) as llm:
        _run(llm, cases)


def test_preempted_image_requests_recompute_with_their_images(vl):
    path, cases = vl("qwen3_5")
    with LLM(path, dtype="float32", kv_cache_memory="1.2MiB", max_num_seqs=8, enable_prefix_caching=False) as llm:
        outs = _run(llm, {**cases, **{f"{n}_again": c for n, c in cases.items()}})
        assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "the cache was meant to force preemption"


def test_prefix_cache_keys_on_pixels(vl):
    """Two different images of the same size with the same text: each answer is its own image's;
    the same image again is a prefix-cache hit with the same answer."""
    path, _ = vl("qwen3_5")
    (a_ids, a_imgs), (b_ids, b_imgs) = (vc.case(path, "one_image", seed=s) for s in (0, 7))
    assert a_ids == b_ids and a_imgs[0].grid_thw == b_imgs[0].grid_thw and a_imgs[0].pixel_hash != b_imgs[0].pixel_hash
    refs = [vc.hf_greedy(path, a_ids, a_imgs, NEW), vc.hf_greedy(path, b_ids, b_imgs, NEW)]
    assert refs[0] != refs[1]
    with LLM(path, dtype="float32", prefix_snapshot_interval=16) as llm:
        got = []
        for imgs in (a_imgs, b_imgs, a_imgs):
            (o,) = llm.generate(prompt_token_ids=[a_ids], images=[imgs], sampling_params=GREEDY)
            got.append(o)
        assert [o.output_token_ids for o in got] == [refs[0], refs[1], refs[0]]
        assert got[1].num_cached_tokens <= a_imgs[0].offset  # nothing of image A served to image B
        assert got[2].num_cached_tokens > a_imgs[0].offset + a_imgs[0].num_tokens(2)
        assert llm.engine.blocks.num_free == llm.capacity().num_blocks


def test_bad_images_are_refused(vl, tmp_path):
    path, cases = vl("qwen3_5")
    ids, imgs, _ = cases["one_image"]
    img = imgs[0]
    bad = {
        "cannot decode": dataclasses.replace(img, data=b"not an image"),
        "pixel_hash is not": dataclasses.replace(img, pixel_hash=bytes(32)),
        "is not the processor's": dataclasses.replace(img, grid_thw=(1, 8, 6)),
    }
    with LLM(path, dtype="float32") as llm:
        for msg, b in bad.items():
            with pytest.raises(ValueError, match=msg):
                llm.generate(prompt_token_ids=[ids], images=[(b,)], sampling_params=GREEDY)
        with pytest.raises(ValueError, match="<|image_pad|> tokens but its 0 image"):
            llm.generate(prompt_token_ids=[ids], sampling_params=GREEDY)
        assert (
            llm.generate(prompt_token_ids=[ids], images=[imgs], sampling_params=GREEDY)[0].output_token_ids
            == cases["one_image"][2]
        )
        assert llm.engine.blocks.num_free == llm.capacity().num_blocks


def test_reserved_image_request_is_never_recomputed(vl):
    """A decode node's request with image placeholders has no pixels (docs/images.md): under memory
    pressure another request gives its pages up; when only such requests are left, the one that
    gives its pages up is aborted rather than recomputed (the router moves it, with its images),
    and the other runs until its context fills the cache ("length")."""
    path, cases = vl("qwen3_5")
    ids = cases["one_image"][0]
    long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    with LLM(
        path,
        dtype="float32",
        kv_cache_memory="0.7MiB",
        max_num_seqs=4,
        enable_prefix_caching=False,
        engine_process=False,
    ) as llm:
        eng = llm.engine
        assert eng.capacity.num_blocks == 16
        assert eng.reserve(ids, long, "img") is not None  # no images given: no pixels here
        assert eng.requests["img"].no_pixels and eng.requests["img"].rope_delta == 0
        eng.activate("img", 5)
        eng.add_request(cases["text_only"][0] * 2, long, "text")
        done = {}
        while eng.has_unfinished():
            done.update((o.request_id, o) for o in eng.step() if o.finished)
        assert done["img"].finish_reason == "length" and done["img"].metrics["num_preemptions"] == 0
        assert done["text"].finish_reason == "length" and done["text"].metrics["num_preemptions"] > 0
        for rid in ("a", "b"):
            assert eng.reserve(ids, SamplingParams(max_tokens=300, ignore_eos=True), rid) is not None
            eng.activate(rid, 5)
        while eng.has_unfinished():
            done.update((o.request_id, o) for o in eng.step() if o.finished)
        assert sorted(done[r].finish_reason for r in "ab") == ["abort", "length"]
        (kept,) = [done[r] for r in "ab" if done[r].finish_reason == "length"]
        assert len(ids) + len(kept.output_token_ids) == 16 * 16 + 1  # the cache's tokens and the last one
        assert eng.blocks.num_free == eng.capacity.num_blocks


def test_mtp_drafts_in_a_released_layout(tmp_path):
    """A vision-language MoE checkpoint with its MTP block as the releases ship it
    (`mtp_num_hidden_layers` in `text_config`, `mtp.*` beside `model.language_model.*`): MTP
    drafts (k = 2) over image and text prompts keep transformers' tokens, and drafts were made."""
    spec = dataclasses.replace(vc.SPEC_VL["qwen3_5_moe"], mtp=True)
    path = vc.make(tmp_path / "ckpt", spec)
    cases = {}
    for name in vc.CASES:
        ids, imgs = vc.case(path, name)
        cases[name] = (ids, imgs, vc.hf_greedy(path, ids, imgs, NEW))
    with LLM(path, dtype="float32", speculative_method="mtp", num_speculative_tokens=2) as llm:
        _run(llm, cases)
        assert sum(llm.engine.scheduler.drafts_per_position) > 0


def test_vllm_multi_modal_data_prompts(vl):
    """vLLM's prompt form: {"prompt": text with one <|vision_start|><|image_pad|><|vision_end|> per
    image, "multi_modal_data": {"image": PIL image or a list}}: the engine expands each placeholder by
    the processor's grid and answers as transformers does on the processed inputs, mixed with a
    text prompt in one call, and as a token-id prompt. An image count that does not match the
    placeholders and another modality are refused naming the prompt."""
    import io

    from PIL import Image

    path, cases = vl("qwen3_5")
    pil = {n: [Image.open(io.BytesIO(b)) for b in vc.case_images(n)] for n in ("one_image", "two_sizes")}
    prompts = [
        {"prompt": vc.chat_text(path, vc.CASES["one_image"][0]), "multi_modal_data": {"image": pil["one_image"][0]}},
        {"prompt": vc.chat_text(path, vc.CASES["two_sizes"][0]), "multi_modal_data": {"image": pil["two_sizes"]}},
        {"prompt": vc.chat_text(path, vc.CASES["text_only"][0])},
    ]
    with LLM(path, dtype="float32") as llm:
        outs = llm.generate(prompts, GREEDY)
        assert [o.output_token_ids for o in outs] == [cases[n][2] for n in ("one_image", "two_sizes", "text_only")]
        assert [o.prompt_token_ids for o in outs] == [cases[n][0] for n in ("one_image", "two_sizes", "text_only")]
        one = {
            "prompt_token_ids": vc.chat_ids(path, vc.CASES["one_image"][0]),
            "multi_modal_data": {"image": pil["one_image"]},
        }
        assert llm.generate([one], GREEDY)[0].output_token_ids == cases["one_image"][2]
        # encoded bytes are decoded as the router decodes them: a photo stored sideways with an EXIF
        # orientation is seen upright, as transformers' load_image turns it (the reference: its pixels)
        turned, upright = _turned_jpeg()
        msgs = [vc.user("What is", None)]
        ids, inputs = vc.chat(path, msgs, [upright])
        got = llm.generate([{"prompt": vc.chat_text(path, msgs), "multi_modal_data": {"image": turned}}], GREEDY)
        assert got[0].prompt_token_ids == ids and got[0].output_token_ids == vc.hf_greedy(path, ids, inputs, NEW)
        with pytest.raises(ValueError, match=r"prompt 1: 2 image\(s\) for 1 <\|image_pad\|>"):
            llm.generate([prompts[0], dict(prompts[0], multi_modal_data={"image": pil["two_sizes"]})], GREEDY)
        with pytest.raises(ValueError, match="prompt 0: multi_modal_data video is not supported"):
            llm.generate([dict(prompts[0], multi_modal_data={"video": [pil["one_image"][0]]})], GREEDY)
        assert llm.engine.blocks.num_free == llm.capacity().num_blocks


def _turned_jpeg() -> tuple[bytes, bytes]:
    """A JPEG stored 120 x 40 with EXIF orientation 6 (shown turned 90 degrees clockwise), and
    PNG bytes of the upright RGB pixels transformers' `load_image` makes of it."""
    import base64
    import io

    import numpy as np
    from PIL import Image
    from transformers.image_utils import load_image

    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    px = np.random.default_rng(6).integers(0, 256, (40, 120, 3), dtype=np.uint8)
    Image.fromarray(px).save(buf, format="JPEG", exif=exif.tobytes())
    ref = load_image(base64.b64encode(buf.getvalue()).decode())  # as transformers loads a base64 image
    assert ref.size == (40, 120)
    out = io.BytesIO()
    ref.save(out, format="PNG")
    return buf.getvalue(), out.getvalue()


def test_vllm_prompts_mm_processor_kwargs_size_the_images(vl):
    """A prompt's mm_processor_kwargs (vLLM's): its images are sized within those pixel bounds,
    the prompt's tokens and the answer are transformers' with its processor called with the same
    keyword arguments, and the same image at another size in the same batch is its own encoder
    cache entry (its answer is its own sizing's). An unknown key is refused naming it."""
    path, _ = vl("qwen3_5")
    img = vc.png(240, 180, seed=4)
    msgs = [vc.user(None, "What is in this picture?")]
    text = vc.chat_text(path, msgs)
    sizings = [None, {"max_pixels": 16384}, {"size": {"shortest_edge": 4096, "longest_edge": 32768}}]
    want = []
    for kw in sizings:
        ids, inputs = vc.expand(path, vc.chat_ids(path, msgs), [img], kw)
        want.append((ids, vc.hf_greedy(path, ids, inputs, NEW, kwargs=kw)))
    assert len({len(ids) for ids, _ in want}) == len(sizings)
    prompts = [
        {"prompt": text, "multi_modal_data": {"image": img}} | ({} if kw is None else {"mm_processor_kwargs": kw})
        for kw in sizings
    ]
    with LLM(path, dtype="float32") as llm:
        for batch in (prompts, prompts[::-1]):  # together, then each after the others are cached
            outs = llm.generate(batch, GREEDY)
            got = [(o.prompt_token_ids, o.output_token_ids) for o in outs]
            assert got == (want if batch is prompts else want[::-1])
        with pytest.raises(ValueError, match="prompt 0: mm_processor_kwargs key 'fps' is not supported"):
            llm.generate([dict(prompts[0], mm_processor_kwargs={"fps": 1})], GREEDY)
