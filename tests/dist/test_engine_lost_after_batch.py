"""EngineRestarts.lost_after (rft/explorer/engine_restart.py) on a real vLLM engine, at a batch's
end with nothing in flight: an engine whose core was stopped (SIGSTOP, a hang) is found by a call
it does not answer within rollout.engine_stall_s, and its core is killed; one whose core was killed
is found dead; a well one is left alone, and a restarted one serves again. The stall watch needs
requests in flight, so without this check a hang after the batch's last answer reached the weight
sync, which waited sync.timeout_s (600 s) for it and failed the job (seen in CI: the stop_engine
fault struck once vLLM had answered every request of the step in the same engine step)."""

import os
import signal
import time
from types import SimpleNamespace

STALL_S = 3.0


def _died_within(engine, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if engine.died():
            return True
        time.sleep(0.05)
    return False


def test_a_stopped_or_dead_engine_is_found_at_the_batchs_end_and_a_well_one_is_left_alone(tmp_path):
    from vllm import SamplingParams

    from rft.config import ModelConfig, RolloutConfig, TinyModelConfig
    from rft.explorer.engine_restart import EngineRestarts
    from rft.explorer.vllm_engine import RolloutEngine
    from rft.models.tiny import create_tiny_model

    model = create_tiny_model(TinyModelConfig(max_position_embeddings=64), str(tmp_path / "model"), seed=0)
    rollout = RolloutConfig(kv_cache_gb=0.1, on_engine_failure="restart", engine_stall_s=STALL_S)
    engine = RolloutEngine(ModelConfig(name="tiny", path=model), rollout, seed=0, max_model_len=64)
    restarts = EngineRestarts(SimpleNamespace(rollout=rollout), SimpleNamespace(rank=0), None, [engine])

    def sample() -> list[int]:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        return engine.run(engine.generate([3, 4, 5], params))[0].token_ids

    try:
        first = sample()
        assert restarts.lost_after("b0") == []

        (core,) = engine.core_pids()
        os.kill(core, signal.SIGSTOP)
        asked = time.monotonic()
        assert restarts.lost_after("b1") == ["engine 0 stopped answering after batch b1's last answer"]
        assert time.monotonic() - asked >= STALL_S
        assert _died_within(engine, 10), "the stopped core was not killed"
        assert "engine 0" in restarts.stalled  # recover() then says it stalled, not died

        engine.restart()  # what recover() does; it serves the same (version 0) weights
        assert engine.core_pids() and engine.core_pids() != [core]
        assert restarts.lost_after("b2") == []
        assert sample() == first

        os.kill(engine.core_pids()[0], signal.SIGKILL)
        assert _died_within(engine, 10)
        assert restarts.lost_after("b3") == ["engine 0 died after batch b3's last answer"]
    finally:
        restarts.close()
        engine.close()
