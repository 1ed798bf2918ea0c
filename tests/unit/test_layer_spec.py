"""trainer.transformer_impl on a machine without Transformer Engine (CI's): what `auto` resolves to,
the errors of an impossible choice, and the HF mapping of TE's parameter names.

TE itself cannot run here (GPUs only; tests/dist/test_transformer_engine.py runs it where it
imports). What can be checked is the naming: TE's spec fuses each pre-norm into the linear after
it, so its norm weights live at `linear_qkv.layer_norm_weight` and `linear_fc1.layer_norm_weight`.
The one-rank test moves the local model's norm weights to exactly those names (and nothing else)
and requires the import, the sync table and the export to treat them as the local norms."""

import pytest
import torch

from rft.trainer.layer_spec import check_saved_layers, resolve_transformer_impl, why_these_layers
from rft.weights.hf_megatron import local_spec_name
from tests.unit.one_rank import init_one_rank, run_one_rank

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the choice on a machine without a GPU")


@NO_GPU
def test_auto_builds_the_local_layers_without_a_gpu_and_explicit_te_names_the_key():
    assert resolve_transformer_impl("auto", lora=False) == "local"
    assert resolve_transformer_impl("auto", lora=True) == "local"
    assert resolve_transformer_impl("local", lora=False) == "local"
    assert why_these_layers("auto", False, "local") == \
        "local (Transformer Engine runs on GPUs only, and this rank has none)"
    assert why_these_layers("auto", True, "local") == "local (LoRA adapters need them)"
    with pytest.raises(ValueError, match=r"^trainer\.transformer_impl=transformer_engine: .*GPUs only.*auto"):
        resolve_transformer_impl("transformer_engine", lora=False)


def test_a_checkpoint_resumes_only_into_the_layers_it_was_saved_from():
    local = {"decoder.layers.0.input_layernorm.weight": None, "decoder.layers.0.self_attention.linear_qkv.weight": None}
    te = {"decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": None,
          "decoder.layers.0.self_attention.linear_qkv._extra_state": None}
    check_saved_layers(local, "local")
    check_saved_layers(te, "transformer_engine")
    check_saved_layers(None, "local")  # a fresh run
    with pytest.raises(ValueError, match="holds transformer_engine layers and this run built local.*"
                                         r"trainer\.transformer_impl=transformer_engine"):
        check_saved_layers(te, "local")
    with pytest.raises(ValueError, match=r"set trainer\.transformer_impl=local"):
        check_saved_layers(local, "transformer_engine")


@pytest.mark.parametrize("name, local", [
    ("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight", "decoder.layers.3.input_layernorm.weight"),
    ("chunks.1.decoder.layers.0.mlp.linear_fc1.layer_norm_weight", "chunks.1.decoder.layers.0.pre_mlp_layernorm.weight"),
    ("decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.0.self_attention.linear_qkv.weight"),
    ("decoder.layers.0.self_attention.q_layernorm.weight", "decoder.layers.0.self_attention.q_layernorm.weight"),
    ("decoder.final_layernorm.weight", "decoder.final_layernorm.weight"),
])
def test_transformer_engine_names_map_to_the_local_specs(name, local):
    assert local_spec_name(name) == local


def _as_transformer_engine_names(model) -> None:
    """Move each layer's pre-norm weights where TE's fused linears hold them."""
    for layer in model.decoder.layers:
        for norm, linear in (("input_layernorm", layer.self_attention.linear_qkv),
                             ("pre_mlp_layernorm", layer.mlp.linear_fc1)):
            linear.register_parameter("layer_norm_weight", getattr(layer, norm).weight)
            setattr(layer, norm, torch.nn.Identity())


def _worker(rank: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    from rft.trainer.hf_weights import export_hf_weights, hf_table, load_hf_weights
    from rft.trainer.model import build_gpt_model, load_hf_state

    init_one_rank(port)
    hf = load_hf_state(model_dir)
    model, geo = build_gpt_model(model_dir)
    _as_transformer_engine_names(model)
    load_hf_weights(model, hf, geo)
    names = [n for n, _ in model.named_parameters()]
    table = [name for name, _, _ in hf_table(model, geo, torch.float32)]
    exported = {n: t.clone() for n, t in export_hf_weights(model, geo)}
    torch.save({"hf": hf, "names": names, "table": table, "exported": exported,
                "norm": model.decoder.layers[1].mlp.linear_fc1.layer_norm_weight.detach().clone()}, out)
    dist.destroy_process_group()


def test_transformer_engine_names_load_and_export_like_the_local_norms(tmp_path):
    res = run_one_rank(_worker, str(tmp_path))
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in res["names"]
    assert not any("input_layernorm" in n or "pre_mlp_layernorm" in n for n in res["names"])
    assert torch.equal(res["norm"], res["hf"]["model.layers.1.post_attention_layernorm.weight"])
    assert res["table"] == list(res["exported"])
    assert sorted(res["exported"]) == sorted(res["hf"])
    for name, tensor in res["exported"].items():
        assert torch.equal(tensor, res["hf"][name]), name
