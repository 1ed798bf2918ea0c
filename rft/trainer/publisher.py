"""Sending the trainer's weights to the rollout engines (and exporting them as HF checkpoints)."""

from __future__ import annotations

import itertools
import os
from dataclasses import replace
from typing import Any

import torch

from rft.config import RFTConfig, wire_dtype
from rft.runtime import faults
from rft.runtime.topology import Topology
from rft.trainer.hf_weights import export_hf_weights, hf_table
from rft.weights.engines import CheckpointSender, make_sender, sync_layout


class WeightPublisher:
    """Sends HF-named weights to the rollout workers, one sender per pipeline stage.

    DP replica 0's TP ranks of each stage gather in lockstep; the stage's TP rank 0 sends.
    `version` (trainer steps done when the weights were sent) is saved with checkpoints.
    """

    def __init__(self, cfg: RFTConfig, topology: Topology, geo):
        from megatron.core import parallel_state as ps

        on_gpu = torch.cuda.is_available()
        layout = sync_layout(cfg, topology, on_gpu)
        stage = ps.get_pipeline_model_parallel_rank()
        self.geo, self.version = geo, 0
        # DP replica 0 exports; under expert parallelism the ranks holding the rest of its experts
        # (expert-DP rank 0) join in, for the experts' all-gather
        self.exports = ps.get_data_parallel_rank() == 0 or ps.get_expert_data_parallel_rank() == 0
        self.wire = getattr(torch, wire_dtype(cfg))
        self.model_dtype = getattr(torch, cfg.model.dtype)  # what exports hold
        self.sender = None
        self.cfg, self.topology, self.on_gpu = cfg, topology, on_gpu
        self.layout, self.stage, self.model_path = layout, stage, cfg.model.path
        self.engines: tuple[list[int] | None, int] = (None, 0)  # the groups' engines (None: all), restarts
        self.adapters = None  # a LoRA stage's adapters (rft/trainer/lora.py)
        self.adapter_sync = False  # send them as adapters (sync.lora=adapter), not merged into the weights
        self.base_sent = False  # adapter syncs: the stage's base weights went out (once per stage and attempt)
        if topology.rank == layout.sender_ranks[stage]:
            assert self.exports and ps.get_tensor_model_parallel_rank() == 0, "sender layout != Megatron's"
            self.sender = make_sender(layout, stage, cfg.model.path)

    def publish(self, model, version: int, engines: list[int] | None = None, restarts: int = 0) -> int:
        """Send the weights as `version` (trainer steps done); returns payload bytes sent by this rank.
        `engines`: the engine leaders to send to, when the job lost some (all by default); the
        weight groups are opened anew without the lost ones, as the engines do (rft/explorer/explorer.py),
        and after `restarts` (the job's engine restarts so far) with the restarted engines' new processes."""
        self.version = version
        if not self.exports:
            return 0
        if self.sender is not None and (engines, restarts) != self.engines:
            self.sender.reopen(sync_layout(self.cfg, self.topology, self.on_gpu, engines, restarts))
            self.engines = (engines, restarts)
        table, tensors = self._payload(model)
        tensors = self._struck_after_first(tensors, version)
        if self.sender is None:
            for _ in tensors:  # the TP all-gathers are collectives: every TP rank iterates
                pass
            return 0
        return self.sender.send(table, tensors, self.version)

    def keep(self, version: int) -> None:
        """The engines hold this rank's weights already (no optimizer step since the last sync):
        they become `version` without anything sent. rft/runtime/faults.py's `sync` point is
        here too, so a fault planned for this step's sync still finds one."""
        self.version = version
        if self.exports:
            faults.strike("sync", version, self.topology.rank, self.cfg.run.output_dir)

    def _struck_after_first(self, tensors, version: int):
        """`tensors`, with rft/runtime/faults.py's `sync` point after the first one (a sync under way)."""
        for index, item in enumerate(tensors):
            yield item
            if index == 0:
                faults.strike("sync", version, self.topology.rank, self.cfg.run.output_dir)

    def begin_stage(self, adapters, adapter_sync: bool) -> None:
        """A stage's LoRA adapters (None: none): sent merged (W + B A), or as PEFT adapters for
        vLLM's LoRA with `adapter_sync`, after the stage's base weights once."""
        self.adapters, self.adapter_sync, self.base_sent = adapters, adapter_sync, False

    def _payload(self, model):
        """(table, tensors) of one sync: every weight (W + B A in a merged LoRA stage), or in an
        adapter stage the adapters alone, after the base weights the first time. Adapters go in
        fp32: a few MB, and vLLM's LoRA applies them in its own dtype."""
        if not self.adapter_sync:
            return hf_table(model, self.geo, self.wire), export_hf_weights(model, self.geo, self._deltas())
        adapter = self.adapters.adapter_tensors(self.geo)
        table = [(name, tuple(t.shape), str(torch.float32)) for name, t in adapter]
        base = iter(())
        if not self.base_sent:
            table = hf_table(model, self.geo, self.wire) + table
            base = export_hf_weights(model, self.geo)
        self.base_sent = True
        return table, itertools.chain(base, adapter)

    def export_hf(self, model, step: int, root: str, keep: int | None = None) -> None:
        """Write the current weights as an HF checkpoint `<root>/v<step>`, keeping the newest `keep`
        (None: all): what mode=bench evaluates (trainer.save_hf)."""
        self._export(model, lambda writer, table, tensors: writer.send(table, tensors, step), root, keep)

    def export_model(self, model, directory: str) -> None:
        """Write the current weights as the HF model directory `directory` (a stage's final model)."""
        self._export(model, lambda writer, table, tensors: writer.write(directory, table, tensors, 0),
                     os.path.dirname(directory), None)

    def _export(self, model, write, root: str, keep: int | None) -> None:
        """An HF directory of the weights in the model's dtype (model.dtype, whatever travels to the
        engines), with every file of the source model besides its weights; a collective over the
        TP (and expert) ranks of DP replica 0, written by each pipeline stage's sender."""
        if not self.exports:
            return
        tensors = export_hf_weights(model, self.geo, self._deltas())
        if self.sender is None:
            for _ in tensors:  # TP all-gathers: every TP rank iterates
                pass
            return
        writer = CheckpointSender(replace(self.layout, checkpoint_dir=root), self.stage, self.model_path,
                                  keep_versions=keep)
        write(writer, hf_table(model, self.geo, self.model_dtype), tensors)

    def _deltas(self) -> dict[str, torch.Tensor] | None:
        return self.adapters.delta_weights() if self.adapters is not None else None

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version = state["version"]
