"""Build a megatron-core GPTModel (this rank's TP x PP shard) shaped like an HF directory.

Weights move in and out through `rft/trainer/hf_weights.py`.

The trainer's model is Megatron's own `GPTModel`, with the local layer spec, which runs on CPU
(gloo, see cpu_compat.py) and on GPUs, or Transformer Engine's on GPUs (layer_spec.py). With
trainer.sequence_parallel the norms and residuals between TP matmuls hold [s/TP, b, h].
"""

from __future__ import annotations

import glob
import math
import os

import torch
import torch.nn.functional as F

from rft.models.families import language_config, rope_frequencies
from rft.trainer.chunks import VirtualStages
from rft.trainer.layer_spec import block_spec, fused_kernel_flags
from rft.trainer.moe import forget_replay_registry, moe_config
from rft.weights.hf_megatron import Geometry, padded_vocab, tp_split_dim

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def init_model_parallel(tp: int, seed: int, pp: int = 1, vpp: int = 1, ep: int = 1) -> None:
    """Megatron's parallel state over the already-initialised default group (trainer ranks);
    `vpp` (trainer.virtual_pipeline_stages) model chunks per pipeline stage; `ep`
    (trainer.expert_parallel_size) ranks of the data-parallel dimension that split each MoE
    layer's experts between them, also over TP ranks: experts are never split by TP (expert TP 1,
    rft/weights/hf_megatron.py says why)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rft.trainer.cpu_compat import apply_cpu_redirects

    apply_cpu_redirects()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                 virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    model_parallel_cuda_manual_seed(seed)


def load_hf_state(path: str) -> dict[str, torch.Tensor]:
    """All tensors of an HF safetensors checkpoint directory."""
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model.path={path!r} holds no *.safetensors weights; save the model with "
                         "save_pretrained(..., safe_serialization=True)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


RECOMPUTE = {  # trainer.recompute -> TransformerConfig keywords: activations recomputed in backward
    "none": {},
    "selective": {"recompute_granularity": "selective"},  # core attention only: the cheap, big part
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}


def build_gpt_model(hf_path: str, dtype: str = "float32", tie_embeddings: bool | None = None,
                    recompute: str = "none", sequence_parallel: bool = False, transformer_impl: str = "local",
                    moe_aux_loss_coeff: float | None = None, logprob_chunk: int = 0):
    """A GPTModel shaped like the HF model at `hf_path` (weights not loaded). Returns (model, geometry).
    `logprob_chunk` (trainer.logprob_chunk) > 0: the policy's logprobs come from the output layer
    chunk by chunk of that many positions (rft/trainer/chunked_logprob.py).

    `tie_embeddings` overrides the HF config's tying (None: as the HF model); the critic is built
    untied so its output layer (a value head) is its own and the PP embedding group leaves it alone.
    `recompute` (trainer.recompute): none | selective (core attention) | full (every layer's
    activations), trading backward compute for activation memory. `sequence_parallel`
    (trainer.sequence_parallel, TP > 1): between the tensor-parallel matmuls each TP rank holds
    [s/TP, b, h] of the hidden states, so norms, residuals and dropout cost 1/TP of the memory
    and compute; microbatches are padded to a multiple of TP (forward.sequence_multiple).
    Under a virtual pipeline (init_model_parallel's `vpp` > 1) the model is the stage's
    `VirtualStages`. `transformer_impl`: the layers, `local` or `transformer_engine`
    (layer_spec.resolve_transformer_impl turns trainer.transformer_impl into one of them).
    A mixture-of-experts model (Qwen3-MoE) gets Megatron's MoE layers (rft/trainer/moe.py), its
    experts split over the expert-parallel ranks; `moe_aux_loss_coeff` (trainer.moe_aux_loss_coeff)
    weighs their load-balancing loss, None: the model's `router_aux_loss_coef`. With TP > 1 it runs
    sequence parallel whatever `sequence_parallel` says: Megatron trains MoE layers under TP only so.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig
    from transformers import AutoConfig

    whole = AutoConfig.from_pretrained(hf_path)
    try:
        geo = Geometry.from_hf(whole)
    except ValueError as err:
        raise ValueError(f"model.path={hf_path!r}: {err}") from None
    hf = language_config(whole)  # a vision-language model's language model (rft/trainer/vision.py)
    inv_freq, attention_scaling = rope_frequencies(hf)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    if geo.num_layers % (pp * vpp):
        raise ValueError(f"trainer.pipeline_parallel_size x virtual_pipeline_stages = {pp} x {vpp} does not "
                         f"divide the model's {geo.num_layers} layers")
    on_gpu = torch.cuda.is_available()
    params_dtype = _DTYPES[dtype]
    if moe_aux_loss_coeff is None:
        moe_aux_loss_coeff = float(getattr(hf, "router_aux_loss_coef", 0.0) or 0.0)
    experts = moe_config(geo, moe_aux_loss_coeff, parallel_state.get_expert_model_parallel_world_size(),
                         transformer_impl)
    config = TransformerConfig(
        num_layers=geo.num_layers,
        hidden_size=geo.hidden_size,
        num_attention_heads=geo.num_heads,
        num_query_groups=geo.num_kv_heads,
        kv_channels=geo.head_dim,
        ffn_hidden_size=hf.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=geo.qkv_bias,
        qk_layernorm=geo.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        sequence_parallel=(sequence_parallel or geo.num_experts > 0) and tp > 1,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        # interleaved: each exchange posted on its own, even ranks sending first and odd ranks
        # receiving first (Megatron-LM's default there). Batched, two messages between the same
        # two stages (PP=2: the previous stage is the next) can be matched crosswise.
        overlap_p2p_comm=vpp > 1,
        batch_p2p_comm=vpp == 1,
        pipeline_dtype=params_dtype,
        # a sent output keeps only its graph until its backward; on GPUs only: NCCL's stream order
        # keeps the memory until the send is done, where gloo's unwaited send (interleaved
        # schedule) would read freed memory
        deallocate_pipeline_outputs=on_gpu,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        perform_initialization=False,  # HF weights are loaded right after
        # YaRN scales RoPE's cos and sin, so q and k, by `attention_scaling`: the scores by its square
        softmax_scale=attention_scaling ** 2 / math.sqrt(geo.head_dim) if attention_scaling != 1.0 else None,
        transformer_impl=transformer_impl,
        **fused_kernel_flags(transformer_impl),
        # losses are normalised by the whole batch's token count (train_step.py): Megatron's DDP
        # must sum gradients over DP replicas, not average them
        calculate_per_token_loss=True,
        **RECOMPUTE[recompute],
        **experts,
        **({"mrope_section": list(geo.mrope_section)} if geo.mrope_section else {}),
    )
    # microbatches differ in length and rows: pipeline stages send a shape before each hidden
    # state. Set after construction: TransformerConfig refuses it with its default MoE token
    # dispatcher, even in a model without experts.
    config.variable_seq_lengths = True
    tied = geo.tied_embeddings if tie_embeddings is None else tie_embeddings
    chunks = []
    model_class, vision = GPTModel, {}
    if geo.vision:
        from rft.trainer.vision import VisionLanguageGPT

        from rft.data.images import image_processor

        model_class, vision = VisionLanguageGPT, {"vision_config": whole.vision_config,
                                                  "image_token_id": whole.image_token_id,
                                                  "image_processor": image_processor(hf_path)}
    for vp_stage in range(vpp) if vpp > 1 else [None]:
        chunk = model_class(
            config=config,
            transformer_layer_spec=block_spec(config, geo.qk_norm, vp_stage),
            vocab_size=padded_vocab(geo.vocab_size, tp),
            max_sequence_length=hf.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            parallel_output=True,
            share_embeddings_and_output_weights=tied,
            position_embedding_type="mrope" if geo.mrope_section else "rope",
            rotary_base=geo.rope_theta,
            vp_stage=vp_stage,
            **vision,
        )
        chunk.real_vocab_size = geo.vocab_size  # logits beyond it are padding (forward.model_forward)
        chunk.logprob_chunk = logprob_chunk  # read by the policy's head (pipeline.policy_head)
        if geo.rope_type != "default":  # scaled RoPE: transformers' frequencies, not megatron-core's
            # variants of them (its llama3 scaling fixes the original context at 8192, for one)
            chunk.rotary_pos_emb.inv_freq = inv_freq.to(chunk.rotary_pos_emb.inv_freq.device)
        _mark_tensor_parallel_shards(chunk)
        chunks.append(chunk.cuda() if on_gpu else chunk)
    if geo.num_experts:
        forget_replay_registry()
    return (chunks[0] if vpp == 1 else VirtualStages(chunks)), geo


def _mark_tensor_parallel_shards(chunk) -> None:
    """Mark each weight split over TP ranks as Megatron's weight initialisation would have
    (`tensor_model_parallel`, `partition_dim`), which perform_initialization=False skips. Megatron's
    grad norm counts an unmarked shard as a TP duplicate, on TP rank 0 only: under TP its clipping
    saw too small a norm (0.255 for 0.320, Qwen2 at TP=2), until tests ran its optimizer on CPU."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for name, param in chunk.named_parameters():
        dim = tp_split_dim(name)
        if dim is not None and not hasattr(param, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(param, True, dim, 1)
