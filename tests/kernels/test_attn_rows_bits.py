"""cpu_ops.attn_decode on the rows of sequences (a prefill, a resumed request's history, rows with
drafts) against the same rows decoded one at a time: the same bits, outputs and KV pages, in
float32 and bfloat16. The engine relies on it (--batch-invariant, docs/engine.md): a prompt
computed as rows and the same tokens decoded one by one must agree exactly. The kernel attends
the query heads of a KV head in several rows of one sequence together (one to four query vectors
a tile, the tile's shared positions then each row's own); the shapes cover tiles of 1, 2, 3 and 4
queries, head sizes that are not multiples of 8 lanes' worth of 64 (48, 72), pages of 4 and 16,
sequences that start mid-page, one and two threads, and the two-pass split of a long prefill
(160 rows of one sequence on two threads: kernels.h attn_two_passes)."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_ops
from tests.helpers.kernel_testing import attn_rows_case

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the CPU operators are not built")

# h, kvh, hd, bs: query vectors per KV head 2 (a tile of two rows), 1 (four rows), 3 (a tile of
# 2 + 1), 8 (two tiles of 4 in one row); hd 48 and 72 leave a part of a 64-dim block; hd 36 (rotary
# half 9) runs the per-row loops' one-lane tails past the last multiple of 8
SHAPES = {
    "gqa2-hd64-p16": (4, 2, 64, 16),
    "mha-hd48-p4": (3, 3, 48, 4),
    "gqa3-hd72-p16": (6, 2, 72, 16),
    "gqa8-hd64-p4": (8, 1, 64, 4),
    "gqa2-hd36-p4": (4, 2, 36, 4),
}
# new rows per sequence and the positions each sequence reaches
LAYOUTS = {
    "one-long-prefill": ([160], [160]),
    "chunks-mid-page": ([3, 1, 7, 2], [70, 20, 23, 9]),
    "many-sequences": ([6] * 10, [40 + 3 * i for i in range(10)]),
}


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x.view(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
@pytest.mark.parametrize("nthreads", [1, 2])
def test_rows_of_a_sequence_give_the_bits_of_rows_decoded_one_at_a_time(dtype, shape, layout, nthreads):
    h, kvh, hd, bs = SHAPES[shape]
    lens, ctx = LAYOUTS[layout]
    g = torch.Generator().manual_seed(list(SHAPES).index(shape) * 10 + list(LAYOUTS).index(layout))
    rd, S, B = hd // 2, len(lens), sum(lens)
    width = max(ctx) // bs + 2
    c = attn_rows_case(g, dtype, h, kvh, hd, rd, bs, lens, ctx, S * width + 3, width)
    qkv, qk_norm, pool, cos, sin, slots, pos = (c[k] for k in ("qkv", "qk_norm", "pool", "cos", "sin", "slots", "pos"))
    starts = c["starts"]
    tables, seq = c["tables"], c["seq"]
    rows_tables = tables[seq].contiguous()
    before = torch.get_num_threads()
    torch.set_num_threads(nthreads)
    try:
        whole_pool = pool.clone()
        whole = cpu_ops.attn_decode(
            qkv, qk_norm, 1e-6, cos, sin, whole_pool, slots, rows_tables, pos + 1, h, kvh, hd**-0.5, seq_starts=starts
        )
        one_pool = pool.clone()
        one = torch.cat(
            [
                cpu_ops.attn_decode(
                    qkv[b : b + 1],
                    qk_norm,
                    1e-6,
                    cos[b : b + 1],
                    sin[b : b + 1],
                    one_pool,
                    slots[b : b + 1],
                    rows_tables[b : b + 1],
                    pos[b : b + 1] + 1,
                    h,
                    kvh,
                    hd**-0.5,
                )
                for b in range(B)
            ]
        )
    finally:
        torch.set_num_threads(before)
    assert torch.equal(_bits(whole), _bits(one)), f"{int((whole != one).any(-1).sum())} of {B} rows differ"
    assert torch.equal(_bits(whole_pool), _bits(one_pool))
