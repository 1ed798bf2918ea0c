"""Core attention through PyTorch's fused kernels, in place of the local layer spec's
`DotProductAttention`.

megatron-core's local spec computes attention by hand: the [b, heads, s, s] score matrix is
materialised in fp32, masked and softmaxed, and kept for the backward. That is what ran on CPU and
on GPUs without Transformer Engine (its fused attention is the only other one Megatron offers),
and for packed microbatches it is fatal: an 8192-token block-diagonal mask made a 0.5B model's
microbatch need more than an H200's 140 GB (measured, tools/gpu_truth.sh). Here:

  - padded rows (`sbhd`): `scaled_dot_product_attention(is_causal=True)`, which picks flash or
    memory-efficient attention on CUDA and the fused kernel on CPU. Rows are right-padded, so
    causality alone keeps every real token off the padding after it.
  - packed rows (`thd`, `PackedSeqParams` from `rft/trainer/forward.py`): on CUDA in bf16/fp16,
    flash attention's variable-length kernel over the cumulative sequence lengths
    (`torch.nn.attention.varlen`), so no token attends across sequences and no work goes to the
    blocks between them; otherwise (CPU, fp32), the same causal kernel once per sequence.

Megatron applies the rotary embedding before this module (per sequence for `thd`, from the same
cumulative lengths), and handles grouped-query heads here by handing both kernels fewer key/value
heads than query heads. Attention dropout is not supported (rft trains with none).
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule


def _varlen_kwargs() -> dict | None:
    """Causal flash-attention keywords of this torch's `varlen_attn` (its API changed in 2.11:
    `is_causal` became a window), or None where it does not exist."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    kwargs = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    return kwargs


class FusedCoreAttention(MegatronModule):
    """Megatron's core-attention interface: q [s, b, heads, d] (packed: [t, heads, d]), k and v
    with the query groups' heads; returns [s, b, heads * d] (packed: [t, heads * d]). Always
    causal: `attention_mask` is not read (rft/trainer/forward.py passes none)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        if (config.attention_dropout if attention_dropout is None else attention_dropout) > 0:
            raise ValueError("FusedCoreAttention: attention dropout is not supported")
        if config.context_parallel_size != 1:
            raise ValueError("FusedCoreAttention: context parallelism needs Transformer Engine's attention")
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.varlen = _varlen_kwargs()

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("FusedCoreAttention: attention bias is not supported")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params).flatten(1)
        seq, batch = query.shape[:2]
        out = self._causal(*(x.permute(1, 2, 0, 3) for x in (query, key, value)))  # [b, heads, s, d]
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)

    def _causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                              enable_gqa=k.shape[-3] != q.shape[-3])

    def _packed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed) -> torch.Tensor:
        cu_seqlens = packed.cu_seqlens_q
        if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and self.varlen is not None:
            from torch.nn.attention.varlen import varlen_attn

            if "enable_gqa" not in self.varlen and k.shape[1] != q.shape[1]:
                k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
            q, k, v = (x.contiguous() for x in (q, k, v))
            return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, packed.max_seqlen_q, packed.max_seqlen_q,
                               scale=self.scale, **self.varlen)
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        # [t, heads, d] -> per sequence [heads, s_i, d]
        per_sequence = zip(*(x.transpose(0, 1).split(lengths, dim=1) for x in (q, k, v)))
        return torch.cat([self._causal(*seq) for seq in per_sequence], dim=1).transpose(0, 1)
