"""rollout.partial_rollout on a real vLLM engine: a weight update arrives while samples are being
generated. Cut, each sample goes on from its tokens so far on the new weights to its full length;
every token keeps the version that sampled it, and its logprob is the one the weights of that
version give it in that context (checked against vLLM's prompt logprobs of the whole sequence
under each version's weights). Against it, the same update without partial rollout waits for the
samples to finish: every token is the old version's."""

import asyncio
import threading
import time

import pytest

TOKENS, SAMPLES = 48, 12


def _generate_while_updating(engine, update, delay_s: float | None = None) -> list:
    """SAMPLES samples of TOKENS tokens each; `update()` runs from another thread `delay_s` after
    they are all in flight (None: no update)."""
    from vllm import SamplingParams

    async def all_samples():
        params = [SamplingParams(max_tokens=TOKENS, temperature=1.0, seed=100 + i, ignore_eos=True)
                  for i in range(SAMPLES)]
        return await asyncio.gather(*(engine.generate(list(range(3, 9 + i)), p) for i, p in enumerate(params)))

    def update_once_in_flight():
        while engine.in_flight < SAMPLES:
            time.sleep(0.001)
        time.sleep(delay_s)
        update()

    updater = threading.Thread(target=update_once_in_flight)
    if delay_s is not None:
        updater.start()
    samples = [c[0] for c in engine.run(all_samples())]
    if delay_s is not None:
        updater.join()
    return samples


def _half_way_s(engine) -> float:
    """Half the time the samples take on this machine now: an update then comes in their middle."""
    start = time.monotonic()
    _generate_while_updating(engine, None)
    return (time.monotonic() - start) / 2


@pytest.fixture(scope="module")
def engine_and_models(tmp_path_factory):
    from rft.config import ModelConfig, RolloutConfig, TinyModelConfig
    from rft.explorer.vllm_engine import RolloutEngine
    from rft.models.tiny import create_tiny_model

    root = tmp_path_factory.mktemp("partial")
    shape = TinyModelConfig(max_position_embeddings=128)
    old, new = (create_tiny_model(shape, str(root / name), seed=seed) for name, seed in (("old", 0), ("new", 1)))
    engine = RolloutEngine(ModelConfig(name="tiny", path=old), RolloutConfig(kv_cache_gb=0.1, partial_rollout=True),
                           seed=0, max_model_len=128)
    yield engine, old, new
    engine.close()


def test_samples_cut_by_an_update_go_on_with_the_new_weights_each_token_labelled_and_scored_by_its_own(
        engine_and_models):
    engine, old, new = engine_and_models
    engine.load_hf_dir(old, version=0)
    samples = _generate_while_updating(engine, lambda: engine.load_hf_dir(new, version=1), _half_way_s(engine))
    prompts = [list(range(3, 9 + i)) for i in range(SAMPLES)]
    assert all(len(s.token_ids) == len(s.logprobs) == len(s.versions) == TOKENS for s in samples)
    assert all(s.versions == sorted(s.versions) and set(s.versions) <= {0, 1} for s in samples)
    cut = [s for s in samples if 0 < s.versions.count(0) < TOKENS]
    assert len(cut) >= SAMPLES // 2, [s.versions.count(0) for s in samples]  # the update came in their middle
    assert engine.continued >= len(cut)

    scored = {}
    for version, path in ((1, new), (0, old)):  # what each version's weights give every token in its context
        engine.load_hf_dir(path, version=version)
        scored[version] = engine.prompt_logprobs([p + s.token_ids for p, s in zip(prompts, samples)])
    for prompt, sample, index in zip(prompts, samples, range(SAMPLES)):
        for t, (logprob, version) in enumerate(zip(sample.logprobs, sample.versions)):
            expected = scored[version][index][len(prompt) - 1 + t]
            assert logprob == pytest.approx(expected, abs=2e-3), (index, t, version)


def test_without_partial_rollout_the_update_waits_for_the_samples_to_finish(engine_and_models):
    engine, old, new = engine_and_models
    engine.load_hf_dir(old, version=0)
    engine.partial = False
    try:
        samples = _generate_while_updating(engine, lambda: engine.load_hf_dir(new, version=1), _half_way_s(engine))
    finally:
        engine.partial = True
    assert all(s.versions == [0] * TOKENS for s in samples)
    assert engine.version == 1
