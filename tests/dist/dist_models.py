"""Small random HF models of each supported family, and a spawn helper for gloo ranks."""

import os

import torch

from rft.runtime.topology import free_port  # noqa: F401  (re-exported for the tests here)
from tests.ranks import start_ranks

VOCAB = 97


def family_config(family: str):
    """One config per mapping rule set: Qwen2 (qkv bias, untied), Llama (tied, rope_theta 1e5
    like SmolLM2), Qwen3 (q/k norms, head_dim != hidden/heads, untied), the scaled RoPEs
    (llama3, llama_linear, qwen2_yarn) and Qwen3-MoE (4 experts, 2 per token, layer 1 dense)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=192, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=False)
    if family == "llama":
        return LlamaConfig(**common, tie_word_embeddings=True, rope_theta=100000.0)
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=64, tie_word_embeddings=False)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**common, head_dim=32, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=True)  # vLLM CPU pads 48 to 64
    # scaled RoPE, with an original context shorter than the test's sequences' wavelengths, so the
    # scaling changes most frequencies: Llama 3.1's, and Qwen2.5's YaRN (its attention factor too)
    if family == "llama3":
        return LlamaConfig(**common, tie_word_embeddings=True, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8})
    if family == "llama_linear":
        return LlamaConfig(**common, tie_word_embeddings=False, rope_scaling={"rope_type": "linear", "factor": 4.0})
    if family == "qwen2_yarn":
        return Qwen2Config(**common, tie_word_embeddings=False, rope_scaling={
            "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})
    raise ValueError(family)


def create_family_model(family: str, out_dir: str, seed: int = 0) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family), dtype=torch.float32)
    with torch.no_grad():  # random norms and biases, so a mis-mapped one cannot hide
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # a router far from uniform: no near-ties in its top k
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(out_dir, safe_serialization=True)
    from rft.models.tiny import build_char_tokenizer

    build_char_tokenizer().save_pretrained(out_dir)  # vLLM wants one; ids past it are still valid
    return out_dir


def init_gloo(rank: int, world: int, port: int, tp: int, pp: int, vpp: int = 1, ep: int = 1) -> None:
    """A gloo default group and Megatron's parallel state, as a trainer rank sets them up."""
    import torch.distributed as dist

    from rft.trainer.model import init_model_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    init_model_parallel(tp, seed=0, pp=pp, vpp=vpp, ep=ep)


def spawn(worker, world: int, *args) -> None:
    start_ranks(worker, world, world, *args)


class LiveActivations:
    """Bytes of tensors autograd saved for backward and has not freed yet, and their peak: a saved
    tensor is wrapped, and the wrapper's end (when backward frees the graph) is counted."""

    def __init__(self):
        self.live = self.peak = 0

    def hooks(self):
        counter = self

        class Saved:
            def __init__(self, tensor):
                self.tensor, self.bytes = tensor, tensor.numel() * tensor.element_size()
                counter.live += self.bytes
                counter.peak = max(counter.peak, counter.live)

            def __del__(self):
                counter.live -= self.bytes

        return torch.autograd.graph.saved_tensors_hooks(Saved, lambda saved: saved.tensor)


def hf_grads(model, geo) -> dict[str, torch.Tensor]:
    """This stage's gradients after the optimizer's sums (over TP for norms, a tied embedding's two
    copies), HF-named and TP-gathered through the weights' exporter."""
    from rft.trainer.hf_weights import export_hf_weights
    from rft.trainer.master_weights import sync_grads

    grads = {n: p.grad for n, p in model.named_parameters()}
    sync_grads(model, grads)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(grads[n])
        # cloned: at TP=1 an exported tensor can be a view of the parameter, restored below
        out = {name: t.clone() for name, t in export_hf_weights(model, geo)}
        for n, p in model.named_parameters():
            p.copy_(weights[n])
    return out
