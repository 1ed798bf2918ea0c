"""Config composition and validation: bad values name the key and the fix; unknown keys fail."""

import os
import re

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from rft.config import RFTConfig, register_configs, stage_configs
from rft.config.checks import validate

CONF = os.path.join(os.path.dirname(__file__), "..", "..", "conf")
GSM8K = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "gsm8k")


def compose_cfg(*overrides: str) -> RFTConfig:
    register_configs()
    with initialize_config_dir(config_dir=os.path.abspath(CONF), version_base="1.3"):
        dcfg = compose(config_name="config", overrides=list(overrides))
    return OmegaConf.to_object(dcfg)


def test_quickstart_composes_and_validates(tmp_path):
    cfg = compose_cfg("+experiment=quickstart", f"run.output_dir={tmp_path}")
    validate(cfg)
    stages = stage_configs(cfg)
    assert [name for name, _ in stages] == ["sft", "grpo"]
    sft, grpo = stages[0][1], stages[1][1]
    assert sft.algorithm.name == "sft" and grpo.algorithm.name == "grpo"
    # stage overrides leave the rest of the section inherited
    assert grpo.algorithm.group_size == cfg.algorithm.group_size
    assert sft.rollout.max_new_tokens == cfg.rollout.max_new_tokens


def test_unknown_key_fails_at_compose():
    with pytest.raises(Exception) as err:
        compose_cfg("+experiment=quickstart", "algorithm.learning_rate=1e-3")
    assert "learning_rate" in str(err.value)


def test_unknown_key_in_stage_override_names_the_stage(tmp_path):
    cfg = compose_cfg("+experiment=quickstart", f"run.output_dir={tmp_path}",
                      "+stages.1.algorithm.clip=0.3")
    with pytest.raises(ValueError, match=r"stages\[1\] \(grpo\)\.algorithm"):
        stage_configs(cfg)


def _small_tasksets(tmp_path) -> list[str]:
    """Tasksets in place of GSM8K's, so these checks do not depend on ../shared/data/gsm8k being
    next to the checkout (it is not in every CI clone)."""
    for name in ("train.jsonl", "test.jsonl"):
        (tmp_path / name).write_text('{"question": "1+1=", "answer": "2"}\n')
    return [f"data.train_path={tmp_path / 'train.jsonl'}", f"data.eval_path={tmp_path / 'test.jsonl'}"]


@pytest.mark.parametrize("override, key", [
    ("algorithm.group_size=1", "algorithm.group_size"),
    ("algorithm.clip_eps=1.5", "algorithm.clip_eps"),
    ("algorithm.reward=bleu", "algorithm.reward"),
    ("model.dtype=int8", "model.dtype"),
    ("buffer.format=csv", "buffer.format"),
    ("trainer.tensor_parallel_size=3", "trainer.tensor_parallel_size"),
    ("sync.interval=0", "sync.interval"),
    ("sync.offset=-1", "sync.offset"),
    ("buffer.max_staleness=-2", "buffer.max_staleness"),
    ("buffer.stale=keep", "buffer.stale"),
    ("algorithm.ppo_epochs=0", "algorithm.ppo_epochs"),
    ("algorithm.mini_batch_size=-4", "algorithm.mini_batch_size"),
    ("trainer.loss_scale=0", "trainer.loss_scale"),
    ("algorithm.lr_decay=exponential", "algorithm.lr_decay"),
    ("algorithm.min_lr_ratio=1.5", "algorithm.min_lr_ratio"),
])
def test_bad_values_name_the_key(tmp_path, override, key):
    cfg = compose_cfg("+experiment=gsm8k_grpo", "model=smollm2_135m", f"run.output_dir={tmp_path}",
                      f"model.path={tmp_path}", *_small_tasksets(tmp_path), override)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        validate(cfg)


def test_missing_model_path_says_how_to_fix(tmp_path):
    cfg = compose_cfg("+experiment=gsm8k_grpo", "model=smollm2_135m", f"model.path={tmp_path}/nope")
    with pytest.raises(ValueError, match=r"model\.path.*prepare_smollm2"):
        validate(cfg)


def test_missing_dataset_file_names_the_key(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    cfg = compose_cfg("+experiment=gsm8k_grpo", "model=smollm2_135m", f"model.path={tmp_path}",
                      f"data.train_path={tmp_path}/missing.jsonl")
    with pytest.raises(ValueError, match=r"data\.train_path.*no such file"):
        validate(cfg)


def test_seed_reaches_every_stage(tmp_path):
    cfg = compose_cfg("+experiment=quickstart", f"run.output_dir={tmp_path}", "seed=7")
    assert all(stage.seed == 7 for _, stage in stage_configs(cfg))


def test_generated_arithmetic_needs_an_eval_path(tmp_path):
    cfg = compose_cfg("+experiment=quickstart", f"run.output_dir={tmp_path}", "data.eval_path=null")
    with pytest.raises(ValueError, match=r"data\.eval_path.*held-out"):
        validate(cfg)


@pytest.mark.parametrize("overrides, key, says", [
    (["cluster.trainer_ranks=2", "trainer.tensor_parallel_size=2"], "trainer.tensor_parallel_size",
     "9 attention heads and 3 key/value heads"),
    (["cluster.trainer_ranks=4", "trainer.pipeline_parallel_size=4"], "trainer.pipeline_parallel_size",
     "30 layers"),
    (["rollout.tensor_parallel_size=2"], "rollout.tensor_parallel_size", "9 attention heads"),
    (["cluster.trainer_ranks=3", "trainer.pipeline_parallel_size=2"], "trainer.pipeline_parallel_size",
     "must divide cluster.trainer_ranks=3"),
    (["sync.engine=rdma"], "sync.engine", "gloo"),
    (["sync.wire_dtype=int4"], "sync.wire_dtype", "bfloat16"),
    (["trainer.sequence_parallel=true"], "trainer.sequence_parallel", "tensor_parallel_size to 2 or more"),
    (["cluster.trainer_ranks=2", "trainer.pipeline_parallel_size=2", "trainer.virtual_pipeline_stages=2"],
     "trainer.virtual_pipeline_stages", "2 x 2 must divide the model's 30 layers"),
    (["trainer.virtual_pipeline_stages=3"], "trainer.virtual_pipeline_stages", "pipeline_parallel_size >= 2"),
    (["trainer.sequence_parallel=true", "cluster.trainer_ranks=3", "trainer.tensor_parallel_size=3",
      "trainer.lora.rank=8"], "trainer.sequence_parallel", "sequence_parallel=false with trainer.lora.rank"),
])
def test_parallel_layout_must_fit_the_model(tmp_path, overrides, key, says):
    """SmolLM2-135M's shape (9 heads, 3 KV heads, 30 layers) read from its config.json."""
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30}')
    cfg = compose_cfg("+experiment=gsm8k_grpo", "model=smollm2_135m", f"run.output_dir={tmp_path}",
                      f"model.path={tmp_path}", *_small_tasksets(tmp_path), *overrides)
    with pytest.raises(ValueError, match=key.replace(".", r"\.")) as err:
        validate(cfg)
    assert says in str(err.value)


@pytest.mark.parametrize("overrides, key, says", [
    (["trainer.transformer_impl=te"], "trainer.transformer_impl", "choose one of ('auto', 'local', 'transformer_engine')"),
    (["trainer.transformer_impl=transformer_engine", "+stages.1.trainer.lora.rank=8"], "trainer.transformer_impl",
     "stages[grpo].trainer.lora.rank > 0 needs the local layers"),
    (["+stages.1.trainer.transformer_impl=local"], "stages[grpo].trainer.transformer_impl",
     "set trainer.transformer_impl globally"),
    (["trainer.transformer_impl=transformer_engine", "cluster.kind=slurm", "cluster.gpus_per_node=0"],
     "trainer.transformer_impl", "this job's nodes get none (cluster.gpus_per_node=0)"),
    pytest.param(["trainer.transformer_impl=transformer_engine", "cluster.kind=local"], "trainer.transformer_impl",
                 "this machine has none", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs no GPU")),
])
def test_transformer_impl_choices_that_cannot_run_are_refused(tmp_path, overrides, key, says):
    cfg = compose_cfg("+experiment=quickstart", f"run.output_dir={tmp_path}", *overrides)
    with pytest.raises(ValueError, match=key.replace(".", r"\.").replace("[", r"\[")) as err:
        validate(cfg)
    assert says in str(err.value)
    if "lora" not in says:  # the same run with the default layers is fine
        validate(compose_cfg("+experiment=quickstart", f"run.output_dir={tmp_path}",
                             *(o for o in overrides if "transformer_impl" not in o)))


def test_sync_layout_names_one_sender_per_stage_and_every_rollout_worker(tmp_path):
    from rft.runtime.topology import Topology
    from rft.weights.engines import sync_layout

    cfg = compose_cfg("+experiment=quickstart", f"run.output_dir={tmp_path}", "cluster.trainer_ranks=8",
                      "trainer.tensor_parallel_size=2", "trainer.pipeline_parallel_size=2",
                      "rollout.tensor_parallel_size=2")
    info = Topology.of(cfg, 0, "node1", 2000)
    assert (info.trainer_ranks, info.rollout_ranks, info.world_size) == (8, 1, 9)
    layout = sync_layout(cfg, info, on_gpu=True)
    # Megatron orders ranks tp, dp, pp: stage 1 starts at rank (tp x dp) = 4
    assert layout.sender_ranks == [0, 4]
    assert layout.receiver_names == ["engine 0 (rollout rank 8) worker 0", "engine 0 (rollout rank 8) worker 1"]
    assert layout.engine == "nccl" and layout.port == 2001 and layout.host == "node1"
    assert layout.bucket_bytes == 512 << 20
    assert layout.peer_names(1)[0] == "trainer rank 4 (PP stage 1)"
    assert sync_layout(cfg, info, on_gpu=False).engine == "gloo"
    assert layout.checkpoint_dir == os.path.join(str(tmp_path), "weights")


def test_site_profile_composes_from_the_repo_and_from_a_config_dir(tmp_path):
    """conf/cluster/site_example.yaml builds on cluster=slurm; a copy in a directory of the user's
    (`--config-dir`, here Hydra's search path) composes alike."""
    cfg = compose_cfg("+experiment=gsm8k_grpo", "model=smollm2_135m", "cluster=site_example", f"run.output_dir={tmp_path}")
    assert cfg.cluster.kind == "slurm" and cfg.cluster.partition == "gpu" and cfg.cluster.max_requeues == 3
    assert cfg.cluster.gpus_per_node is None and cfg.cluster.env["NCCL_IB_HCA"] == "mlx5"
    site = tmp_path / "site" / "cluster"
    site.mkdir(parents=True)
    example = open(os.path.join(CONF, "cluster", "site_example.yaml")).read()
    (site / "mysite.yaml").write_text(example.replace("partition: gpu", "partition: a100"))
    cfg = compose_cfg("+experiment=gsm8k_grpo", "model=smollm2_135m", "cluster=mysite", f"run.output_dir={tmp_path}",
                      f"hydra.searchpath=[file://{tmp_path / 'site'}]", "cluster.account=other")
    assert cfg.cluster.kind == "slurm" and cfg.cluster.partition == "a100" and cfg.cluster.account == "other"


@pytest.mark.parametrize("overrides, why", [
    (["rollout.on_engine_failure=retry"], "use fail"),
    (["rollout.on_engine_failure=continue"], "two engines or more"),  # the quickstart has one
    (["rollout.on_engine_failure=continue", "cluster.rollout_ranks=2", "mode=explore"], "mode=both"),
    # on GPUs the weights go over NCCL, whose watchdog aborts the trainer when an engine dies mid-broadcast
    (["rollout.on_engine_failure=continue", "cluster.rollout_ranks=2", "cluster.gpus_per_node=3"],
     "cannot be honoured over NCCL"),
])
def test_on_engine_failure_needs_something_to_go_on_with(tmp_path, overrides, why):
    cfg = compose_cfg("+experiment=quickstart", "cluster=local", f"run.output_dir={tmp_path}", *overrides)
    with pytest.raises(ValueError, match=rf"rollout\.on_engine_failure=.*{why}"):
        validate(cfg)
    cfg = compose_cfg("+experiment=quickstart", "cluster=local", f"run.output_dir={tmp_path}",
                      "rollout.on_engine_failure=continue", "cluster.rollout_ranks=2")
    validate(cfg)  # two engines training: accepted
    cfg.cluster.gpus_per_node, cfg.sync.engine = 3, "gloo"
    validate(cfg)  # and on GPUs over gloo, where a lost engine times out


@pytest.mark.parametrize("overrides, key, says", [
    (["mode=explore"], "mode", "between the trainer's weight syncs"),
    (["sync.free_run=true"], "sync.free_run", "lockstep schedule"),
    (["cluster.colocate=true"], "cluster.colocate", "the GPU it shares"),
    (["sync.engine=checkpoint"], "sync.engine", "gloo and nccl only"),
    (["rollout.openai_api=true"], "rollout.openai_api", "open sessions"),
    (["rollout.max_engine_restarts=0"], "rollout.max_engine_restarts", "1 or more"),
    # a stalled engine's requests would time out, and their samples fail, before it is restarted
    (["rollout.engine_stall_s=700"], "rollout.engine_stall_s", "below rollout.task_timeout_s"),
])
def test_restarting_engines_is_refused_where_a_restart_would_go_wrong(tmp_path, overrides, key, says):
    """rollout.on_engine_failure=restart (rft/explorer/engine_restart.py) restarts an engine inside a
    lockstep step and re-forms gloo or NCCL weight groups: elsewhere it is refused, naming the key."""
    cfg = compose_cfg("+experiment=quickstart", "cluster=local", f"run.output_dir={tmp_path}",
                      "rollout.on_engine_failure=restart", *overrides)
    with pytest.raises(ValueError, match=rf"^{re.escape(key)}=.*{says}"):
        validate(cfg)
    validate(compose_cfg("+experiment=quickstart", "cluster=local", f"run.output_dir={tmp_path}",
                         "rollout.on_engine_failure=restart"))  # one engine, lockstep, gloo: accepted


@pytest.mark.parametrize("change, says", [
    ({"model_type": "mistral"}, "model_type 'mistral' is not supported; supported: llama, qwen2, qwen3, qwen3_moe"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic' is not supported; supported: "
                                                                  "default, linear, llama3, yarn"),
    ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "rope_type 'longrope' is not supported"),
    ({"mlp_bias": True}, "MLP biases"),
])
def test_a_model_the_trainer_cannot_build_is_refused_at_launch(tmp_path, change, says):
    """Before anything starts, naming model.path, what in its config.json, and what is supported;
    the same model with llama3 or YaRN RoPE is accepted."""
    import json

    llama = {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
             "hidden_size": 128, "max_position_embeddings": 128, "rope_theta": 500000.0,
             "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 64}}
    cfg = compose_cfg("+experiment=quickstart", f"run.output_dir={tmp_path}")
    cfg.model.tiny, cfg.model.path = None, str(tmp_path / "model")
    os.makedirs(cfg.model.path)
    for config, ok in ((llama, True), ({**llama, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                        "original_max_position_embeddings": 64}}, True), ({**llama, **change}, False)):
        with open(os.path.join(cfg.model.path, "config.json"), "w") as f:
            json.dump(config, f)
        if ok:
            validate(cfg)
            continue
        with pytest.raises(ValueError, match="model.path=") as err:
            validate(cfg)
        assert says in str(err.value)


@pytest.mark.parametrize("overrides, key, says", [
    (["trainer.expert_parallel_size=3"], "trainer.expert_parallel_size", "must divide the model's 4 experts"),
    (["trainer.expert_parallel_size=4"], "trainer.expert_parallel_size",
     "must divide the 2 trainer ranks of a pipeline stage"),
    (["trainer.moe_aux_loss_coeff=-1"], "trainer.moe_aux_loss_coeff", "use 0"),
    (["+stages.1.trainer.lora.rank=8"], "stages[grpo].trainer.lora.rank", "not supported on mixture-of-experts"),
    (["trainer.routing_replay=trainer"], "trainer.routing_replay", "choose one of ('none', 'rollout')"),
    (["trainer.routing_replay=rollout", "trainer.recompute=full"], "trainer.routing_replay",
     "recompute=none or selective"),
])
def test_expert_parallelism_that_cannot_split_the_experts_is_refused_naming_the_key(tmp_path, overrides, key, says):
    """A Qwen3-MoE model with 4 experts on 2 trainer ranks: EP 2 is accepted; EP on a dense model,
    EP that does not divide the experts or a stage's ranks, a negative aux coefficient and LoRA
    are refused before anything starts."""
    import json

    moe = {"model_type": "qwen3_moe", "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
           "hidden_size": 128, "max_position_embeddings": 128, "num_experts": 4, "num_experts_per_tok": 2}
    base = ("+experiment=quickstart", f"run.output_dir={tmp_path}", "cluster.trainer_ranks=2")
    cfg = compose_cfg(*base, "trainer.expert_parallel_size=2", "trainer.routing_replay=rollout")
    cfg.model.tiny, cfg.model.path = None, str(tmp_path / "model")
    os.makedirs(cfg.model.path)
    with open(os.path.join(cfg.model.path, "config.json"), "w") as f:
        json.dump(moe, f)
    validate(cfg)
    bad = compose_cfg(*base, *overrides)
    bad.model.tiny, bad.model.path = None, cfg.model.path
    with pytest.raises(ValueError, match=re.escape(key)) as err:
        validate(bad)
    assert says in str(err.value)
    with open(os.path.join(cfg.model.path, "config.json"), "w") as f:
        json.dump({**moe, "model_type": "qwen3", "num_experts": 0}, f)
    with pytest.raises(ValueError, match="trainer.expert_parallel_size") as err:
        validate(cfg)
    assert "has no experts to split" in str(err.value)
    cfg.trainer.expert_parallel_size = 1
    with pytest.raises(ValueError, match="trainer.routing_replay") as err:
        validate(cfg)
    assert "has no experts to route" in str(err.value)


async def judged_reward(trajectory, task):
    """A user's reward that asks the judge engine, and says so in its metadata."""
    return 1.0


judged_reward.rft_meta = {"judge_kind": "generate"}


def test_what_a_reward_or_advantage_needs_comes_from_its_metadata_not_its_name(tmp_path):
    """A user's reward marked judge_kind=generate asks for judge ranks as llm_judge does; an
    advantage registered needs_group (grpo_per_turn) asks for groups as grpo does."""
    cfg = compose_cfg("+experiment=quickstart", f"run.output_dir={tmp_path}",
                      f"algorithm.reward={__name__}.judged_reward")
    with pytest.raises(ValueError, match=r"algorithm.reward='.*judged_reward' is invalid: asks a judge engine"):
        validate(cfg)
    cfg = compose_cfg("+experiment=quickstart", f"run.output_dir={tmp_path}", "algorithm.advantage=grpo_per_turn",
                      "algorithm.group_size=1")
    with pytest.raises(ValueError, match="algorithm.group_size=1 is invalid: advantage grpo_per_turn compares"):
        validate(cfg)


def test_weights_travel_in_the_engines_dtype_unless_set_and_the_plan_says_when_they_differ(tmp_path):
    from rft.config import wire_dtype
    from rft.launch.plan import wire_note

    cfg = compose_cfg("+experiment=quickstart", f"run.output_dir={tmp_path}", "model.dtype=float32")
    assert wire_dtype(cfg) == "float32" and wire_note(cfg) == ""  # vLLM samples from the weights trained
    cfg = compose_cfg("+experiment=quickstart", f"run.output_dir={tmp_path}", "sync.wire_dtype=bfloat16")
    assert wire_dtype(cfg) == "bfloat16"
    assert "weights travel in bfloat16 (sync.wire_dtype) and vLLM runs float32 (model.dtype)" in wire_note(cfg)
