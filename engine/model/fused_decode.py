"""The CPU decode step as one C call through the decoder layers (kernels/cpu_decode.py).

`fused_decode(model, pools)` describes the model's layers to the C side once (weights and cache
pools stay where they are), or returns None when the model is not one the call covers: packed
weights (engine/model/linear.py "packed": float32, or bfloat16 in batch-invariant mode), dense
MLPs, a float32 GDN state, one tensor-parallel rank, C ops built. Qwen35Model.forward takes it
for steps of decode rows of one token each without MTP's hidden states; every other step
(prefill, drafts, MoE, bfloat16 without batch-invariant mode, CUDA) runs layer by layer.
"""

from __future__ import annotations

import logging

import torch

from engine.cache.allocator import CachePools
from engine.model.layers import MLP, Attention, GatedDeltaNet
from kernels import cpu_ops
from kernels.cpu_decode import AttnLayerSpec, DecodeLayers, GDNLayerSpec

log = logging.getLogger("pdserve.engine")


def _packed(*lins) -> bool:
    return all(lin.kind == "packed" for lin in lins)


def fused_decode(model, pools: CachePools, tp: int) -> DecodeLayers | None:
    dtype = model.embed.dtype
    if tp != 1 or dtype not in (torch.float32, torch.bfloat16) or model.embed.device.type != "cpu":
        return None
    if not cpu_ops.available(dtype):
        return None
    if any(t.dtype != torch.float32 for t in pools.recurrent.values()):  # --mamba-ssm-cache-dtype bfloat16
        log.info("decode steps run layer by layer: the one-call decode takes a float32 GDN state only")
        return None
    specs = []
    for i, layer in enumerate(model.layers):
        mlp, mixer = layer.mlp, layer.mixer
        if not isinstance(mlp, MLP) or not _packed(mlp.w.w_gate_up, mlp.w.w_down):
            return None
        common = dict(
            in_norm=layer.input_norm.contiguous(),
            post_norm=layer.post_norm.contiguous(),
            w_gu=mlp.w.w_gate_up.w,
            w_down=mlp.w.w_down.w,
            n_gu=mlp.w.w_gate_up.out_features,
            eps=mixer.eps,
        )
        if isinstance(mixer, GatedDeltaNet):
            w = mixer.w
            if not _packed(w.w_in, w.w_out):
                return None
            specs.append(
                GDNLayerSpec(
                    w_in=w.w_in.w,
                    w_out=w.w_out.w,
                    n_in=w.w_in.out_features,
                    conv_w=w.conv.contiguous(),
                    conv_pool=pools.conv[i],
                    rec_pool=pools.recurrent[i],
                    neg_A=mixer.neg_A.contiguous(),
                    dt_bias=mixer.dt_bias.contiguous(),
                    norm_w=w.norm.contiguous(),
                    hk=mixer.hk,
                    hv=mixer.hv,
                    dk=mixer.dk,
                    dv=mixer.dv,
                    **common,
                )
            )
        elif isinstance(mixer, Attention):
            w = mixer.w
            if not _packed(w.w_qkv, w.w_o):
                return None
            specs.append(
                AttnLayerSpec(
                    w_in=w.w_qkv.w,
                    w_out=w.w_o.w,
                    n_in=w.w_qkv.out_features,
                    qk_norm=mixer.qk_norm.contiguous(),
                    kv_pool=pools.kv[i],
                    h=mixer.h,
                    kvh=mixer.kvh,
                    scale=mixer.scale,
                    **common,
                )
            )
        else:
            return None
    try:
        return DecodeLayers(model.embed.shape[1], model.eps, specs, dtype)
    except (ValueError, RuntimeError) as e:
        log.info("decode steps run layer by layer: %s", e)
        return None
