"""A checkpoint written in the background (trainer.async_save, rft/runtime/background_save.py) holds
the state at the step it was taken, though the trainer trains on while it is written: two gloo
ranks save, with the CPU trainer's optimizer (fp32 masters and AdamW's state in tensors of their
own) or Megatron's distributed one (views into its buffers), then take an optimizer step (in place,
on the same CPU tensors) before the write may start; loaded, the checkpoint gives the weights of the save
and, one step later, exactly the weights the trainer reached. A write that fails on one rank fails
the completion on every rank, and nothing of it stays. The write is the rank's writer process's
(rft/runtime/shard_writer.py), from the shared memory the tensors were copied to at the save."""

import os
import signal
import threading

import pytest
import torch
from dist_models import create_family_model, free_port, init_gloo, spawn

from tests.unit.test_mixed_precision import PROMPTS, RESPONSES


def _worker(rank: int, world: int, port: int, model_dir: str, run_dir: str, out: str, fail_rank: int,
            failure: str, megatron: bool) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from rft.config import AlgorithmConfig
    from rft.runtime.checkpoint import finish_shards, sharded_dir, start_shards
    from rft.runtime.shard_writer import ShardWriter
    from rft.trainer.hf_weights import export_hf_weights, load_hf_weights
    from rft.trainer.master_weights import MasterWeightsOptimizer
    from rft.trainer.megatron_optimizer import MegatronOptimizer
    from rft.trainer.model import build_gpt_model, load_hf_state
    from rft.trainer.optimizer_contract import LossScale
    from rft.trainer.sharded_state import ShardedModel
    from rft.trainer.step_batch import StepBatch
    from rft.trainer.train_step import train_step

    class HeldWriter(ShardWriter):
        """The rank's writer process, handed the staged write only once the trainer has stepped on
        (what a slow filesystem does). On `fail_rank` the write fails: its files in a directory that
        is not there (`spoil`), or the writer process killed (`kill`)."""

        def _send(self, message: tuple) -> None:
            def later() -> None:
                trained_on.wait(60)
                arena, jobs, *rest = message
                if rank == fail_rank and failure == "kill":
                    os.kill(self.pid, signal.SIGKILL)
                    return
                if rank == fail_rank:
                    jobs = [(os.path.join(run_dir, "gone", os.path.basename(name)), *job) for name, *job in jobs]
                super(HeldWriter, self)._send((arena, jobs, *rest))

            threading.Thread(target=later, daemon=True).start()

    trained_on = threading.Event()
    writer = HeldWriter()
    for signum in (signal.SIGTERM, signal.SIGUSR2):  # Slurm's, to every process of the job: the writer lives on
        os.kill(writer.pid, signum)

    init_gloo(rank, world, port, 1, 1)
    model, geo = build_gpt_model(model_dir, "float32")
    load_hf_weights(model, load_hf_state(model_dir), geo)
    if megatron:  # DP shards of the Adam state
        optimizer = MegatronOptimizer(model, 1e-3, 0.0, (0.9, 0.99), None, True)
    else:  # what rft/trainer/optimizer.py builds on CPU
        optimizer = MasterWeightsOptimizer(model, lambda masters: torch.optim.AdamW(masters, lr=1e-3, betas=(0.9, 0.99)),
                                           LossScale(1.0, dynamic=False))
    batch = StepBatch(prompt_ids=PROMPTS, response_ids=RESPONSES)
    algo = AlgorithmConfig(name="sft", lr=1e-3, grad_clip=1.0)

    def shards(loading: bool) -> dict:
        return {"model": ShardedModel(model).checkpoint_shards("model.", loading),
                "optimizer": optimizer.checkpoint_shards("optimizer.", loading)}

    train_step(model, optimizer, batch, algo, 2, 0)
    saved = {n: t.clone() for n, t in export_hf_weights(model, geo)}
    pending = start_shards(run_dir, 1, shards(False), {"step": 1}, writer)
    train_step(model, optimizer, batch, algo, 2, 0)  # in place, while the write waits
    reached = {n: t.clone() for n, t in export_hf_weights(model, geo)}
    trained_on.set()
    try:
        files = finish_shards(pending)
    except Exception as err:
        torch.save({"error": f"{type(err).__name__}: {err}"}, f"{out}.rank{rank}.pt")
        dist.destroy_process_group()
        return
    loaded = dist_checkpointing.load(shards(True), sharded_dir(os.path.join(run_dir, "checkpoints", "step00000001")))
    ShardedModel(model).load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    after_load = {n: t.clone() for n, t in export_hf_weights(model, geo)}
    train_step(model, optimizer, batch, algo, 2, 0)  # the step taken while the checkpoint was written
    again = {n: t.clone() for n, t in export_hf_weights(model, geo)}
    torch.save({"saved": saved, "reached": reached, "after_load": after_load, "again": again, "files": files},
               f"{out}.rank{rank}.pt")
    dist.destroy_process_group()


def _run(tmp_path, fail_rank: int, failure: str = "", megatron: bool = True) -> list[dict]:
    model_dir = create_family_model("qwen2", str(tmp_path / "hf"))
    out = str(tmp_path / "out")
    spawn(_worker, 2, free_port(), model_dir, str(tmp_path / "run"), out, fail_rank, failure, megatron)
    return [torch.load(f"{out}.rank{rank}.pt") for rank in range(2)]


@pytest.mark.parametrize("megatron", [False, True], ids=["cpu_optimizer", "megatron_distributed"])
def test_a_background_checkpoint_holds_the_state_of_its_step_while_the_trainer_trains_on(tmp_path, megatron):
    results = _run(tmp_path, fail_rank=-1, megatron=megatron)
    assert ".metadata" in results[0]["files"]  # completed: megatron-core's index of the checkpoint, by rank 0
    for rank, result in enumerate(results):
        assert any(not torch.equal(result["saved"][n], result["reached"][n]) for n in result["saved"])  # it did train on
        for name, want in result["saved"].items():
            assert torch.equal(result["after_load"][name], want), f"rank {rank}: {name} is not the saved step's"
        for name, want in result["reached"].items():
            assert torch.equal(result["again"][name], want), f"rank {rank}: {name} after a step from the checkpoint"


@pytest.mark.parametrize("failure, says", [("spoil", "No such file or directory"),
                                            ("kill", "the checkpoint writer process (pid")])
def test_a_write_that_fails_on_one_rank_fails_on_every_rank_and_leaves_nothing(tmp_path, failure, says):
    fail_rank = 0  # rank 0 writes (of this small model rank 1 may hold nothing to write)
    results = _run(tmp_path, fail_rank, failure)
    assert says in results[fail_rank]["error"], results[fail_rank]
    assert "another trainer rank failed to write its shards" in results[1 - fail_rank]["error"], results[1 - fail_rank]
    assert not (tmp_path / "run" / "checkpoints" / "step00000001" / "sharded").exists()  # nothing half-written
