"""The sparse mixture-of-experts block of Qwen3.5-MoE and Qwen3-Next on one tensor-parallel rank:
the replicated router, this rank's slice of every routed expert's intermediate dimension, and the
gated shared expert; one all-reduce completes the partial sums, as for the dense MLP."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.layers import MLP, AllReduce, MLPWeights
from engine.model.linear import Linear
from kernels import fused_moe, select_experts


def _no_reduce(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass
class MoEWeights:
    router: Linear  # [E, hidden], replicated
    w13: torch.Tensor  # [E, 2 * I_r, hidden]: each expert's [gate_r | up_r]
    w2: torch.Tensor  # [E, hidden, I_r]
    shared: dict  # the shared expert's MLPWeights fields (its intermediate sliced like the experts')
    shared_gate: Linear  # [1, hidden], replicated
    # FP8 experts (engine/loader.py): w13 / w2 float8 with their block scales, None otherwise
    w13_scale_inv: torch.Tensor | None = None  # [E, 2 * I_r / bn, hidden / bk]
    w2_scale_inv: torch.Tensor | None = None  # [E, hidden / bn, I_r / bk]
    block_size: tuple[int, int] | None = None


class SparseMoE:
    def __init__(
        self, w: MoEWeights, top_k: int, renormalize: bool, all_reduce: AllReduce, row_invariant: bool = False
    ):
        self.w, self.top_k, self.renormalize, self.all_reduce = w, top_k, renormalize, all_reduce
        self.row_invariant = row_invariant  # --batch-invariant (kernels/moe.py fused_moe)
        self.shared = MLP(MLPWeights(**w.shared), _no_reduce)  # reduced together with the experts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(self.w.router(x), self.top_k, self.renormalize)
        w = self.w
        out = fused_moe(
            x, w.w13, w.w2, topk_weights, topk_ids, w.w13_scale_inv, w.w2_scale_inv, w.block_size, self.row_invariant
        )
        out += torch.sigmoid(self.w.shared_gate(x)) * self.shared(x)
        return self.all_reduce(out)
