"""Ops on the hot path of the hybrid stack.

Each op has a PyTorch implementation here (the CPU path, and the reference for the Triton
kernels); `naive.py` holds per-token loops used only by tests.
"""

from kernels.attention import causal_attention, gather_kv, paged_attention, store_kv
from kernels.conv import causal_conv1d, causal_conv1d_update, conv_update_
from kernels.fp8 import dequant_fp8_block, fp8_block_linear, narrow_fp8_block, quant_fp8_block
from kernels.gdn import gdn_chunk_prefill, gdn_decode_step_, gdn_recurrent, l2norm
from kernels.moe import fused_moe, select_experts
from kernels.norm import add_rms_norm, gated_rms_norm, rms_norm

__all__ = [
    "add_rms_norm",
    "causal_attention",
    "causal_conv1d",
    "causal_conv1d_update",
    "conv_update_",
    "dequant_fp8_block",
    "fp8_block_linear",
    "fused_moe",
    "gated_rms_norm",
    "gather_kv",
    "gdn_chunk_prefill",
    "gdn_decode_step_",
    "gdn_recurrent",
    "l2norm",
    "narrow_fp8_block",
    "paged_attention",
    "quant_fp8_block",
    "rms_norm",
    "select_experts",
    "store_kv",
]
