"""Weight bytes per GPU of a Qwen3.5 MoE checkpoint at a tensor-parallel size, as the loader holds
them (engine/loader.py, engine/shard.py), with the dense projections of an FP8 checkpoint
dequantized to bfloat16 or kept in FP8 (--fp8-dense). Computed from a config's sizes, not measured.

    python bench/weight_memory.py                    the table in docs/engine.md, with the arithmetic
    python bench/weight_memory.py --config config.json --tp 4 [--fp8]   a checkpoint's own config"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass

# Sizes of the published configs (text model; MTP block and vision tower not counted). From this
# repository: Qwen3.5-35B-A3B's hidden 2048, 40 layers, 16 heads, 2 KV heads of 256, GDN 16 key /
# 32 value heads of 128, conv 4, expert intermediate 512 (bench/transfer.py, bench/moe.py,
# docs/benchmarks.md) and Qwen3.5-397B-A17B's 45 GDN layers of 64 value heads of 128 (issue 24).
# Not in this repository, taken from the published config.json as several public copies quote it
# (not checked against the original here): the expert counts, both shared-expert sizes, the
# vocabulary (248,320) and the rest of Qwen3.5-397B-A17B's sizes.
FIELDS: tuple[str, ...] = ("hidden_size", "num_hidden_layers", "num_attention_heads", "linear_num_value_heads")
FIELDS += ("num_experts", "moe_intermediate_size", "shared_expert_intermediate_size", "full_attention_interval")
FIELDS += ("num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_key_head_dim", "linear_value_head_dim")
FIELDS += ("linear_conv_kernel_dim", "vocab_size", "tie_word_embeddings")
BOTH = (4, 2, 256, 16, 128, 128, 4, 248320, False)  # the last nine fields, the same in both
CONFIGS = {
    "Qwen3.5-35B-A3B": dict(zip(FIELDS, (2048, 40, 16, 32, 256, 512, 512, *BOTH))),
    "Qwen3.5-397B-A17B": dict(zip(FIELDS, (4096, 60, 32, 64, 512, 1024, 1024, *BOTH))),
}
# (checkpoint, FP8 release, TP): the deployments docs/engine.md sizes
TABLE = (("Qwen3.5-397B-A17B", True, 8), ("Qwen3.5-35B-A3B", False, 2), ("Qwen3.5-35B-A3B", True, 2))
BLOCK = 128  # the FP8 releases' [128, 128] weight blocks, one float32 scale each
GIB = 1024**3


@dataclass
class Bytes:
    """One rank's weight bytes by kind (what the loader builds)."""

    embed_head: int = 0  # embedding and LM head, bfloat16, whole on every rank
    dense_bf16: int = 0  # quantized dense projections dequantized to bfloat16
    dense_fp8: int = 0  # the same kept in FP8: 1 byte an element + a float32 scale per block
    experts: int = 0  # routed experts (FP8 + scales in an FP8 release, else bfloat16)
    other: int = 0  # never quantized: GDN b/a rows, routers, shared-expert gates, conv, norms

    def total(self, keep: bool) -> int:
        return self.embed_head + (self.dense_fp8 if keep else self.dense_bf16) + self.experts + self.other


def rank_bytes(c: dict, tp: int, fp8: bool, log=None, block: int = BLOCK) -> Bytes:
    """Bytes of one rank (slices in whole `block`s); `log(line)` gets each term's arithmetic."""
    say = log or (lambda line: None)

    def fp8_bytes(rows: int, cols: int, count: int = 1) -> int:
        return count * (rows * cols + 4 * math.ceil(rows / block) * math.ceil(cols / block))

    c = {**c, **c.get("text_config", {})}  # a vision-language config nests the text model's
    H, b = c["hidden_size"], Bytes()
    types = c.get("layer_types")  # else every full_attention_interval-th layer is full attention
    n_full = types.count("full_attention") if types else c["num_hidden_layers"] // c["full_attention_interval"]
    n_gdn = c["num_hidden_layers"] - n_full
    heads, hd = c["num_attention_heads"] // tp, c["head_dim"]
    kv = c["num_key_value_heads"] // tp if tp <= c["num_key_value_heads"] else 1  # replicated past TP = KV heads
    hk, hv = c["linear_num_key_heads"] // tp, c["linear_num_value_heads"] // tp
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    E, ie, ish = c["num_experts"], c["moe_intermediate_size"] // tp, c["shared_expert_intermediate_size"] // tp
    conv = 2 * hk * dk + hv * dv
    # (rows, cols, layers) of each quantized dense projection held by the rank
    dense = [
        (2 * heads * hd, H, n_full, "q_proj [q|gate]"),
        (kv * hd, H, 2 * n_full, "k_proj, v_proj"),
        (H, heads * hd, n_full, "o_proj"),
        (conv, H, n_gdn, "in_proj_qkv"),
        (hv * dv, H, n_gdn, "in_proj_z"),
        (H, hv * dv, n_gdn, "out_proj"),
        (2 * ish, H, n_gdn + n_full, "shared expert gate_up"),
        (H, ish, n_gdn + n_full, "shared expert down"),
    ]
    embed = c["vocab_size"] * H * (1 if c["tie_word_embeddings"] else 2)
    b.embed_head = 2 * embed
    say(f"  embedding + LM head: {embed:,} elements x 2 B (bfloat16, whole on every rank)")
    for rows, cols, layers, name in dense:
        b.dense_bf16 += 2 * rows * cols * layers
        b.dense_fp8 += fp8_bytes(rows, cols, layers)
        say(f"  {name}: [{rows} x {cols}] x {layers} layers: x 2 B dequantized, x 1 B + 4 B per {block}^2 block kept")
    per_layer = 2 * ie * H + H * ie
    b.experts = (fp8_bytes(2 * ie, H, E) + fp8_bytes(H, ie, E) if fp8 else 2 * E * per_layer) * c["num_hidden_layers"]
    say(
        f"  routed experts: {E} x [{2 * ie} x {H} + {H} x {ie}] x {c['num_hidden_layers']} layers, {'FP8' if fp8 else 'x 2 B'}"
    )
    other = n_gdn * (2 * hv * H + conv * c["linear_conv_kernel_dim"] + 2 * hv + dv)  # b, a, conv, A_log, dt_bias, norm
    other += c["num_hidden_layers"] * (E * H + H + 2 * H) + n_full * 2 * hd + H  # routers, gates, norms
    b.other = 2 * other
    say(f"  unquantized rest (GDN b/a rows, conv, routers, shared-expert gates, norms): {other:,} elements x 2 B")
    if not fp8:
        b.dense_fp8 = b.dense_bf16  # a bfloat16 release has nothing to keep in FP8
    return b


def row(name: str, fp8: bool, tp: int, b: Bytes) -> str:
    g = lambda n: f"{n / GIB:.2f}"  # noqa: E731
    dense = f"{g(b.dense_bf16)} / {g(b.dense_fp8)}" if fp8 else g(b.dense_bf16)
    total = f"{g(b.total(False))} / {g(b.total(True))}" if fp8 else g(b.total(False))
    label = name + ("-FP8" if fp8 else " (bf16)")
    return f"| {label} | {tp} | {g(b.embed_head)} | {dense} | {g(b.experts)} | {g(b.other)} | {total} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="a Qwen3.5 MoE config.json (its text_config when nested)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--fp8", action="store_true", help="an FP8 release: experts FP8, dense FP8 kept or dequantized")
    args = ap.parse_args()
    rows: tuple[tuple[str, bool, int], ...] = TABLE
    configs = dict(CONFIGS)
    if args.config:
        configs = {args.config: json.load(open(args.config))}
        rows = ((args.config, args.fp8, args.tp),)
    head = ["checkpoint", "TP", "embedding + LM head", "dense projections, dequantized / kept FP8"]
    head += ["routed experts", "unquantized rest", "per GPU, dequantized / kept FP8"]
    print("| " + " | ".join(head) + " |")
    print("|---|---|---|---|---|---|---|")
    lines = []
    for name, fp8, tp in rows:
        log: list[str] = []
        print(row(name, fp8, tp, rank_bytes(configs[name], tp, fp8, log.append)))
        lines += [f"{name}{'-FP8' if fp8 else ''} at TP {tp}, per rank:", *log]
    print("\nGiB (2^30 bytes) per GPU, weights only; the arithmetic:\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
