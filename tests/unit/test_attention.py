"""The trainer's core attention (rft/trainer/attention.py) against attention written out by hand:
softmax(q k^T * scale + causal mask) v, grouped-query heads repeated, one sequence at a time.

  - padded rows ([s, b, heads, d], Megatron's sbhd) and packed rows ([t, heads, d] with cumulative
    sequence lengths, thd) give the reference's outputs and gradients on CPU;
  - on a GPU (marked `gpu`), the packed path runs flash attention's variable-length kernel, and the
    tiny model's packed forward equals its padded one in fp32 and in bf16 (CI has no GPU: run it
    where one is lent, tools/gpu_truth.sh)."""

import math

import pytest
import torch

from rft.trainer.forward import thd_params
from tests.unit.one_rank import init_one_rank, run_one_rank

HEADS, GROUPS, DIM = 4, 2, 16
LENGTHS = [5, 1, 9, 3]


def _attention(device: str = "cpu"):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from rft.trainer.attention import FusedCoreAttention

    config = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, kv_channels=DIM, use_cpu_initialization=True,
                               hidden_dropout=0.0, attention_dropout=0.0)
    return FusedCoreAttention(config, 1, AttnMaskType.causal, "self").to(device)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One sequence, [s, heads, d] in, [s, heads * d] out, in float64."""
    q, k, v = (x.double().transpose(0, 1) for x in (q, k, v))
    k, v = (x.repeat_interleave(HEADS // GROUPS, dim=0) for x in (k, v))
    scores = q @ k.transpose(1, 2) / math.sqrt(DIM)
    future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
    out = scores.masked_fill(future, float("-inf")).softmax(-1) @ v
    return out.transpose(0, 1).reshape(q.shape[1], -1)


def _qkv(total: int, device: str = "cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(total, heads, DIM, generator=gen).to(device, dtype).requires_grad_()
            for heads in (HEADS, GROUPS, GROUPS)]


def _packed_reference(q, k, v) -> torch.Tensor:
    split = [x.split(LENGTHS) for x in (q, k, v)]
    return torch.cat([_reference(*seq) for seq in zip(*split)])


def test_padded_rows_are_causal_attention_per_row():
    attention = _attention()
    width = max(LENGTHS)
    q, k, v = (x.reshape(width, 2, -1, DIM) for x in _qkv(width * 2))  # [s, b=2, heads, d]
    out = attention(q, k, v, None)
    assert out.shape == (width, 2, HEADS * DIM)
    for row in range(2):
        expected = _reference(q[:, row], k[:, row], v[:, row])
        torch.testing.assert_close(out[:, row].double(), expected, atol=1e-5, rtol=1e-5)


def test_packed_rows_attend_within_their_sequence_only():
    attention = _attention()
    q, k, v = _qkv(sum(LENGTHS))
    out = attention(q, k, v, None, packed_seq_params=thd_params(LENGTHS, torch.device("cpu")))
    expected = _packed_reference(q, k, v)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    # and the gradients: the backward must not leak across sequences either
    out.square().sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    expected.square().sum().backward()
    for got, x in zip(grads, (q, k, v)):
        torch.testing.assert_close(got.double(), x.grad.double(), atol=1e-5, rtol=1e-5)


def _model_worker(rank: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    from rft.trainer.forward import forward_logprobs, pack_microbatch
    from rft.trainer.hf_weights import load_hf_weights
    from rft.trainer.model import build_gpt_model, load_hf_state
    from tests.unit.test_packing import MASKS, PROMPTS, RESPONSES

    init_one_rank(port)
    res = {}
    for dtype in ("float32", "bfloat16"):
        model, geo = build_gpt_model(model_dir, dtype)
        load_hf_weights(model, load_hf_state(model_dir), geo)
        with torch.no_grad():
            for packed in (False, True):
                mb = pack_microbatch(PROMPTS, RESPONSES, 0, torch.device("cuda"), MASKS, packed=packed)
                logprobs, entropy = forward_logprobs(model, mb)
                res[dtype, packed] = (logprobs.float().cpu(), entropy.float().cpu(), mb.loss_mask.cpu())
    torch.save(res, out)
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flash_kernels_on_gpu(tmp_path):
    from rft.trainer.attention import _varlen_kwargs

    assert _varlen_kwargs() is not None, "this torch has no torch.nn.attention.varlen"
    attention = _attention("cuda")
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        q, k, v = _qkv(sum(LENGTHS), "cuda", dtype)
        out = attention(q, k, v, None, packed_seq_params=thd_params(LENGTHS, torch.device("cuda")))
        torch.testing.assert_close(out.double(), _packed_reference(q, k, v), atol=tolerance, rtol=tolerance)
    res = run_one_rank(_model_worker, str(tmp_path), gpu=True)
    for dtype, tolerance in (("float32", 1e-4), ("bfloat16", 5e-2)):
        (pad_lp, pad_ent, mask), (pack_lp, pack_ent, _) = res[dtype, False], res[dtype, True]
        valid = mask > 0
        print(f"tiny model {dtype} on {torch.cuda.get_device_name()}: packed - padded logprobs, max "
              f"{float((pack_lp - pad_lp)[valid].abs().max()):.3g}")
        torch.testing.assert_close(pack_lp[valid], pad_lp[valid], atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(pack_ent[valid], pad_ent[valid], atol=tolerance, rtol=tolerance)
