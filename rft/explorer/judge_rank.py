"""A judge rank's whole life: serve a frozen vLLM engine to the job's rewards until the run ends.

    start vLLM on judge.model (default: the policy's starting weights, model.path)
    serve vLLM's OpenAI server on this node's address, with a token of its own
    publish {url, token, model} in the job's store (rft/explorer/judge.py connects to it)
    wait until rank 0 says the run is over, or its store is gone

With judge.kind=classify the engine runs vLLM's pooling runner on an HF sequence-classification
model (a reward model) and the server offers /classify instead of completions.
A judge keeps no state, never votes, never syncs and saves nothing: a resumed job starts it afresh.
On GPU nodes a judge engine of TP k spans k tasks; the first runs vLLM, the others hold their GPUs.
"""

from __future__ import annotations

import datetime
import os
import secrets
import time
from dataclasses import replace

from rft.config import RFTConfig, RolloutConfig, context_length, judge_model
from rft.explorer.judge import JudgeEndpoint
from rft.runtime.preemption import control_store
from rft.runtime.rendezvous import host_address
from rft.runtime.topology import Topology, engine_devices, free_port


def judge_rollout_config(cfg: RFTConfig) -> RolloutConfig:
    """The engine settings of a judge: its own TP, cache and batch limits."""
    j = cfg.judge
    return replace(cfg.rollout, tensor_parallel_size=j.tensor_parallel_size, kv_cache_gb=j.kv_cache_gb,
                   gpu_memory_utilization=j.gpu_memory_utilization, max_num_seqs=j.max_num_seqs)


def run_judge(cfg: RFTConfig, topology: Topology, poll_s: float = 2.0) -> dict:
    from rft.explorer.openai_endpoint import OpenAIEndpoint
    from rft.explorer.vllm_engine import RolloutEngine

    index = topology.judge_index
    if cfg.cluster.gpus_per_node:
        os.environ["CUDA_VISIBLE_DEVICES"] = engine_devices(cfg.cluster, topology.judge_span)
    model = judge_model(cfg)
    runner = "pooling" if cfg.judge.kind == "classify" else "generate"  # a reward model scores, never samples
    engine = RolloutEngine(model, judge_rollout_config(cfg), cfg.seed, context_length(model), name=f"judge {index}",
                           runner=runner)
    # served at this node's address on the network the job meets on: its host name may not
    # resolve on the other nodes, or resolve to a loopback address here
    host = "127.0.0.1" if cfg.cluster.kind == "local" else host_address(topology.master_addr)
    endpoint = OpenAIEndpoint(engine, host, free_port(), secrets.token_urlsafe(32), served_name="judge")
    endpoint.start()
    store = control_store(topology, datetime.timedelta(seconds=cfg.sync.timeout_s))
    store.set(JudgeEndpoint.store_key(index), JudgeEndpoint(endpoint.url, endpoint.token, "judge").to_json())
    print(f"judge {index}: serving {model.path} at {endpoint.url}", flush=True)
    try:
        while not store.check(["rft-finished"]):
            time.sleep(poll_s)
    except Exception:  # the store went away with rank 0: the run is over (or failed, and Slurm ends the job)
        pass
    # no orderly shutdown of the engine: a judge that hangs would hang it too; the supervising
    # task kills what is left of this rank's process group (rft/runtime/supervisor.py)
    return {"role": "judge", "rank": topology.rank, "engine": index}
