"""The Slurm side without a cluster: rank/role/rendezvous from a multi-node Slurm environment, the
sbatch script for a 4-node x 8-GPU profile (golden file), and request checks that name the key."""

import json
import os
import sys

import pytest

from rft.config import ClusterConfig, RFTConfig
from rft.launch.slurm import check_request, make_executor, tasks_per_node
from rft.runtime.topology import Topology, engine_devices, port_for_job
from rft.weights.engines import sync_layout

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "sbatch_4x8_gpu.sh")
GOLDEN_TWO_ENGINES = os.path.join(os.path.dirname(__file__), "golden", "sbatch_2x8_gpu_2_engines.sh")


def _slurm_env(monkeypatch, procid: int, nodeid: int, localid: int, ntasks: int = 32) -> None:
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    for key, value in {"SLURM_JOB_ID": "123457", "SLURM_NTASKS": ntasks, "SLURM_JOB_NUM_NODES": 4,
                       "SLURM_NODEID": nodeid, "SLURM_JOB_NODELIST": "gpu-a[017-018],gpu-b[003,009]",
                       "SLURM_PROCID": procid, "SLURM_LOCALID": localid}.items():
        monkeypatch.setenv(key, str(value))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)  # restored after a rank sets it
    # Slurm's NodeAddr of the first node, as `scontrol show node` gives it on the cluster
    monkeypatch.setattr("rft.runtime.rendezvous.slurm_node_addr", {"gpu-a017": "10.1.0.17"}.get)


@pytest.mark.parametrize("procid, nodeid, localid, role, role_rank", [
    (0, 0, 0, "trainer", 0), (9, 1, 1, "trainer", 9), (23, 2, 7, "trainer", 23),
    (24, 3, 0, "rollout", 0), (31, 3, 7, "rollout", 7)])
def test_ranks_roles_and_rendezvous_from_a_4_node_job(monkeypatch, procid, nodeid, localid, role, role_rank):
    _slurm_env(monkeypatch, procid, nodeid, localid)
    cfg = RFTConfig(cluster=ClusterConfig(kind="slurm", trainer_ranks=24, rollout_ranks=8, nodes=4, gpus_per_node=8))
    info = Topology.from_env(cfg, master_port=0)
    assert (info.rank, info.world_size, info.role, info.role_rank) == (procid, 32, role, role_rank)
    # rank 0 runs on the first node of the allocation, reached at its Slurm address
    assert (info.master_node, info.master_addr) == ("gpu-a017", "10.1.0.17")
    assert os.environ.get("GLOO_SOCKET_IFNAME")  # gloo binds the interface towards it, not the host name's
    assert info.master_port == port_for_job("123457") == 20000 + 3457 * 3
    # below Linux's default ephemeral range (32768-60999) for every job id, with its two store ports
    assert max(port_for_job(str(job)) + 2 for job in range(100_000)) < 32768
    assert info.weight_port == info.master_port + 1
    assert os.environ["LOCAL_RANK"] == str(localid)  # which GPU of its node the rank takes


def test_task_count_must_match_the_config(monkeypatch):
    _slurm_env(monkeypatch, 0, 0, 0, ntasks=16)
    with pytest.raises(RuntimeError, match="16 tasks"):
        Topology.from_env(RFTConfig(cluster=ClusterConfig(kind="slurm", trainer_ranks=24, rollout_ranks=8)), master_port=0)


def _gpu_profile(tmp_path) -> RFTConfig:
    cfg = RFTConfig()
    cfg.run.name, cfg.run.output_dir = "gsm8k", str(tmp_path)
    c = cfg.cluster
    c.kind, c.nodes, c.gpus_per_node, c.trainer_ranks, c.rollout_ranks = "slurm", 4, 8, 24, 8
    c.partition, c.account, c.qos, c.constraint = "gpu", "proj123", "normal", "a100&ib"
    c.cpus_per_task, c.mem_gb, c.timeout_min = 8, 480, 720
    c.setup = ["module load cuda/12.4"]
    c.env = {"NCCL_IB_HCA": "mlx5", "NCCL_SOCKET_IFNAME": "ib0"}
    c.sbatch_extra = {"reservation": "rl"}
    c.container_image, c.container_binds = str(tmp_path / "rft.sif"), ["/scratch", "/datasets"]
    return cfg


def _two_engines_profile(tmp_path) -> RFTConfig:
    """2 nodes x 8 GPUs: 8 trainer ranks on node 0, two vLLM engines of TP 4 on node 1."""
    cfg = _gpu_profile(tmp_path)
    cfg.cluster.nodes, cfg.cluster.trainer_ranks, cfg.cluster.rollout_ranks = 2, 8, 8
    cfg.rollout.tensor_parallel_size = 4
    return cfg


def _srun_on_path(tmp_path, monkeypatch) -> None:
    """submitit's executor refuses to exist where `srun` is not on PATH; writing the script needs none."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "bin" / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")


@pytest.mark.parametrize("profile, golden", [(_gpu_profile, GOLDEN),
                                             (_two_engines_profile, GOLDEN_TWO_ENGINES)])
def test_sbatch_script_matches_golden(tmp_path, monkeypatch, profile, golden):
    _srun_on_path(tmp_path, monkeypatch)
    cfg = profile(tmp_path)
    executor = make_executor(cfg, str(tmp_path / "logs"))
    script = executor._make_submission_file_text(executor._submitit_command_str, "JOBID")
    from rft.launch.slurm import REPO

    script = script.replace(str(tmp_path), "RUN").replace(REPO, "REPO")
    if os.environ.get("RFT_UPDATE_GOLDEN"):
        with open(golden, "w") as f:
            f.write(script)
    with open(golden) as f:
        assert script == f.read(), "sbatch script changed; rerun with RFT_UPDATE_GOLDEN=1 if intended"
    assert tasks_per_node(cfg) == 8


def test_with_continue_a_lost_engines_task_does_not_end_the_others(tmp_path, monkeypatch):
    _srun_on_path(tmp_path, monkeypatch)
    cfg = _two_engines_profile(tmp_path)
    srun_lines, scripts = {}, {}
    for policy in ("fail", "continue"):
        cfg.rollout.on_engine_failure = policy
        executor = make_executor(cfg, str(tmp_path / "logs"))
        scripts[policy] = executor._make_submission_file_text(executor._submitit_command_str, "JOBID")
        srun_lines[policy] = next(line for line in scripts[policy].splitlines() if line.startswith("srun "))
    assert "--kill-on-bad-exit=0" in srun_lines["continue"]  # whatever the site's KillOnBadExit
    assert "kill-on-bad-exit" not in srun_lines["fail"]  # fail fast: the site's default stands
    # a node that fails ends neither the job nor its step (Slurm's default ends both)
    assert "#SBATCH --no-kill\n" in scripts["continue"] and " --no-kill " in srun_lines["continue"]
    assert "no-kill" not in scripts["fail"]


def test_two_engines_of_tp4_share_the_second_node(tmp_path, monkeypatch):
    """Each engine's leader runs it on its own four GPUs of node 1; the weight groups reach every
    worker of both engines; the plan names both engines, their ranks and node."""
    from rft.launch.plan import engines_line

    cfg = _two_engines_profile(tmp_path)
    (tmp_path / "rft.sif").write_text("")
    check_request(cfg)
    roles = {}
    for procid in (7, 8, 9, 11, 12, 15):
        _slurm_env(monkeypatch, procid, procid // 8, procid % 8, ntasks=16)
        info = Topology.from_env(cfg, master_port=0)
        roles[procid] = "follower" if info.is_engine_follower else \
            (info.role if info.role == "trainer" else f"engine {info.engine_index}")
    assert roles == {7: "trainer", 8: "engine 0", 9: "follower", 11: "follower", 12: "engine 1", 15: "follower"}
    monkeypatch.setenv("LOCAL_RANK", "4")  # rank 12 is the fifth task on node 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    assert engine_devices(cfg.cluster, info.engine_span) == "4,5,6,7"
    assert info.voting_ranks == list(range(8)) + [8, 12]
    layout = sync_layout(cfg, info, on_gpu=True)
    assert layout.receiver_names == [f"engine {e} (rollout rank {8 + 4 * e}) worker {w}"
                                     for e in range(2) for w in range(4)]
    assert engines_line(cfg).splitlines()[:2] == ["engine 0: ranks 8-11 on node 1 of 2",
                                                  "engine 1: ranks 12-15 on node 1 of 2"]


def test_a_tp4_judge_engine_takes_the_last_four_gpus(tmp_path, monkeypatch):
    """2 nodes x 8 GPUs: 8 trainer ranks, one TP-4 rollout engine, one TP-4 judge engine after it.
    The judge's leader runs vLLM on its four GPUs, its followers hold theirs, and no judge rank votes."""

    cfg = _two_engines_profile(tmp_path)
    cfg.cluster.rollout_ranks, cfg.cluster.judge_ranks, cfg.judge.tensor_parallel_size = 4, 4, 4
    (tmp_path / "rft.sif").write_text("")
    check_request(cfg)
    roles = {}
    for procid in (11, 12, 13, 15):
        _slurm_env(monkeypatch, procid, procid // 8, procid % 8, ntasks=16)
        info = Topology.from_env(cfg, master_port=0)
        roles[procid] = (info.role, info.role_rank, info.is_judge_follower)
    assert roles == {11: ("rollout", 3, False), 12: ("judge", 0, False), 13: ("judge", 1, True),
                     15: ("judge", 3, True)}
    monkeypatch.setenv("LOCAL_RANK", "4")  # rank 12 is the fifth task on node 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    assert engine_devices(cfg.cluster, info.judge_span) == "4,5,6,7"
    assert info.voting_ranks == list(range(8)) + [8]
    cfg.cluster.judge_ranks, cfg.cluster.rollout_ranks = 6, 2  # the judge would straddle the nodes
    with pytest.raises(ValueError, match="judge.tensor_parallel_size"):
        check_request(cfg)


@pytest.mark.parametrize("change, key", [
    ({"trainer_ranks": 20}, "cluster.trainer_ranks + cluster.rollout_ranks"),
    ({"container_image": "/nope/rft.sif"}, "cluster.container_image"),
    ({"gpus_per_node": 0, "nodes": 3}, "cluster.nodes"),
])
def test_bad_requests_name_the_key(tmp_path, change, key):
    cfg = _gpu_profile(tmp_path)
    (tmp_path / "rft.sif").write_text("")
    for k, v in change.items():
        setattr(cfg.cluster, k, v)
    with pytest.raises(ValueError, match=key.replace(".", r"\.").replace("+", r"\+")):
        check_request(cfg)


def test_a_rollout_engine_with_tp8_spans_the_last_node(tmp_path, monkeypatch):
    """24 trainer GPUs + one vLLM engine with TP=8 on the 4th node: its first task runs the engine
    on all 8 GPUs of that node, the other 7 only hold their GPU; the stop vote and the weight
    groups include the leader only, once per TP worker."""

    cfg = _gpu_profile(tmp_path)
    cfg.rollout.tensor_parallel_size = 8
    roles = {}
    for procid in (0, 23, 24, 25, 31):
        _slurm_env(monkeypatch, procid, procid // 8, procid % 8)
        info = Topology.from_env(cfg, master_port=0)
        roles[procid] = "follower" if info.is_engine_follower else info.role
    assert roles == {0: "trainer", 23: "trainer", 24: "rollout", 25: "follower", 31: "follower"}
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7,0,1,2,3")  # whatever order Slurm gives
    assert engine_devices(cfg.cluster, info.engine_span) == "4,5,6,7,0,1,2,3"
    assert info.voting_ranks == list(range(24)) + [24]
    layout = sync_layout(cfg, info, on_gpu=True)
    assert layout.receiver_names == [f"engine 0 (rollout rank 24) worker {w}" for w in range(8)]
    assert layout.sender_ranks == [0]
    # followers save no checkpoint file: a checkpoint of the voting ranks is complete without them
    from rft.runtime.checkpoint import newest_complete, save_rank_state

    for rank in info.voting_ranks:
        save_rank_state(str(tmp_path / "run"), 5, rank, {"rank": rank})
    assert newest_complete(str(tmp_path / "run"), info.voting_ranks).done == 5


@pytest.mark.parametrize("rollout_tp, trainer_ranks, rollout_ranks, message", [
    (3, 24, 8, "must be a multiple of rollout.tensor_parallel_size=3"),
    (4, 24, 0, "need at least one vLLM engine: 4 rank"),
])
def test_rollout_tp_that_does_not_fit_its_ranks_names_the_key(tmp_path, rollout_tp, trainer_ranks, rollout_ranks,
                                                              message):
    from rft.config.checks import validate

    cfg = _gpu_profile(tmp_path)
    cfg.rollout.tensor_parallel_size = rollout_tp
    cfg.cluster.trainer_ranks, cfg.cluster.rollout_ranks = trainer_ranks, rollout_ranks
    with pytest.raises(ValueError, match=f"cluster.rollout_ranks={rollout_ranks}.*{message}"):
        validate(cfg)


def test_an_engine_may_not_straddle_two_nodes(tmp_path):
    cfg = _gpu_profile(tmp_path)
    (tmp_path / "rft.sif").write_text("")
    cfg.rollout.tensor_parallel_size = 8
    cfg.cluster.trainer_ranks, cfg.cluster.rollout_ranks = 20, 12  # engine would start at GPU 4 of node 3
    with pytest.raises(ValueError, match=r"rollout\.tensor_parallel_size=8 .*must divide cluster\.gpus_per_node"):
        check_request(cfg)


@pytest.mark.parametrize("preset", ["llama3_1_8b_instruct", "qwen2_5_7b_instruct", "qwen3_8b"])
def test_a_model_preset_lays_its_model_out_on_a_node_of_8_gpus(tmp_path, monkeypatch, preset):
    """conf/model/<preset>.yaml under the GSM8K recipe on Slurm, with the model's published shape
    (tests/unit/golden/model_configs/): every check passes (TP splits the heads, RoPE and
    architecture supported, the ranks fit the node), the ranks are laid out as the preset says,
    and the sbatch script is the golden one."""
    import shutil

    from rft.config.checks import validate
    from tests.unit.test_config import _small_tasksets, compose_cfg

    _srun_on_path(tmp_path, monkeypatch)
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(os.path.join(os.path.dirname(__file__), "golden", "model_configs", f"{preset}.json"),
                model / "config.json")
    cfg = compose_cfg("+experiment=gsm8k_grpo", f"model={preset}", "cluster=slurm", f"model.path={model}",
                      f"run.output_dir={tmp_path / 'run'}", *_small_tasksets(tmp_path))
    validate(cfg)
    check_request(cfg)
    topology = Topology.of(cfg)
    assert (topology.trainer_ranks, topology.engine_count, cfg.trainer.tensor_parallel_size) == (4, 4, 2)
    assert cfg.model.dtype == "bfloat16" and cfg.trainer.max_tokens_per_microbatch == 8192  # the recipe's still
    _matches_golden_sbatch(cfg, tmp_path, "sbatch_1x8_gpu_dense_preset.sh")  # one for all three


def test_the_moe_preset_lays_qwen3_30b_a3b_out_on_four_nodes_of_8_gpus(tmp_path, monkeypatch):
    """conf/model/qwen3_30b_a3b.yaml: two nodes of trainer ranks (PP 2, each stage's 8 ranks
    splitting the experts, EP 8) and two of vLLM engines (TP 2); every check passes, the sbatch
    script is the golden one."""
    import shutil

    from rft.config.checks import validate
    from tests.unit.test_config import _small_tasksets, compose_cfg

    _srun_on_path(tmp_path, monkeypatch)
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(os.path.join(os.path.dirname(__file__), "golden", "model_configs", "qwen3_30b_a3b.json"),
                model / "config.json")
    cfg = compose_cfg("+experiment=gsm8k_grpo", "model=qwen3_30b_a3b", "cluster=slurm", f"model.path={model}",
                      f"run.output_dir={tmp_path / 'run'}", *_small_tasksets(tmp_path))
    validate(cfg)
    check_request(cfg)
    topology = Topology.of(cfg)
    assert (topology.trainer_ranks, topology.engine_count, cfg.rollout.tensor_parallel_size) == (16, 8, 2)
    assert (cfg.trainer.pipeline_parallel_size, cfg.trainer.expert_parallel_size) == (2, 8)
    _matches_golden_sbatch(cfg, tmp_path, "sbatch_4x8_gpu_moe_preset.sh")


def _matches_golden_sbatch(cfg, tmp_path, name: str) -> None:
    from rft.launch.slurm import REPO

    executor = make_executor(cfg, str(tmp_path / "logs"))
    script = executor._make_submission_file_text(executor._submitit_command_str, "JOBID")
    script = script.replace(str(tmp_path), "RUN").replace(sys.executable, "PYTHON").replace(REPO, "REPO")
    golden = os.path.join(os.path.dirname(__file__), "golden", name)
    if os.environ.get("RFT_UPDATE_GOLDEN"):
        with open(golden, "w") as f:
            f.write(script)
    with open(golden) as f:
        assert script == f.read(), "sbatch script changed; rerun with RFT_UPDATE_GOLDEN=1 if intended"


@pytest.mark.parametrize("preset, layout", [("qwen2_5_vl_7b_instruct", (4, 4, 2)), ("qwen2_5_vl_3b_instruct", (4, 4, 1))])
def test_the_geometry3k_recipe_lays_each_vision_language_preset_out_on_a_node_of_8_gpus(tmp_path, monkeypatch, preset,
                                                                                        layout):
    """conf/experiment/geometry3k_vl_grpo.yaml with each Qwen2.5-VL preset and the model's published
    config.json (the Hub's older flat layout, rope_scaling's mrope_section): every check passes and
    the ranks are laid out as the preset's memory arithmetic says."""
    import shutil

    from rft.config.checks import validate
    from rft.models.families import mrope_section
    from tests.unit.test_config import compose_cfg

    _srun_on_path(tmp_path, monkeypatch)
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(os.path.join(os.path.dirname(__file__), "golden", "model_configs", f"{preset}.json"),
                model / "config.json")
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text('{"problem": "<image>Find x.", "answer": "2", "images": "x.png"}\n')
    cfg = compose_cfg("+experiment=geometry3k_vl_grpo", f"model={preset}", "cluster=slurm", f"model.path={model}",
                      f"run.output_dir={tmp_path / 'run'}", f"data.train_path={tmp_path / 'train.jsonl'}",
                      f"data.eval_path={tmp_path / 'test.jsonl'}")
    validate(cfg)
    check_request(cfg)
    topology = Topology.of(cfg)
    assert (topology.trainer_ranks, topology.engine_count, cfg.trainer.tensor_parallel_size) == layout
    assert cfg.data.image_key == "images" and cfg.data.prompt_template.format(prompt="x").endswith("put in \\boxed{}.")
    assert mrope_section(json.loads((model / "config.json").read_text())) == (16, 24, 24)
