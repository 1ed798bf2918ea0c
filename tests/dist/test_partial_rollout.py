"""rollout.partial_rollout on a real vLLM engine: a weight update arrives while samples are being
generated. Cut, each sample goes on from its tokens so far on the new weights to its full length;
every token keeps the version that sampled it, and its logprob is the one the weights of that
version give it in that context (checked against vLLM's prompt logprobs of the whole sequence
under each version's weights). Against it, the same update without partial rollout waits for the
samples to finish: every token is the old version's. And what a stop signal keeps of the requests
in flight, a restarted attempt goes on from."""

import asyncio
import json
import threading
import time

import pytest

TOKENS, SAMPLES = 96, 12


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


def _a_third_in_s(engine) -> float:
    """A third of the time the samples take on this machine now: an update then comes in their
    middle, even if the machine gets slower meanwhile."""
    _generate_while_updating(engine, None)  # the first generation after a load is slower
    start = time.monotonic()
    _generate_while_updating(engine, None)
    return (time.monotonic() - start) / 3


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
    samples = _generate_while_updating(engine, lambda: engine.load_hf_dir(new, version=1), _a_third_in_s(engine))
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
        samples = _generate_while_updating(engine, lambda: engine.load_hf_dir(new, version=1), _a_third_in_s(engine))
    finally:
        engine.partial = True
    assert all(s.versions == [0] * TOKENS for s in samples)
    assert engine.version == 1


def test_requests_kept_in_flight_at_a_stop_are_gone_on_from_by_a_restarted_attempt(engine_and_models, tmp_path):
    """Slurm's stop signal while a free-running step generates (RolloutEngine.keep_in_flight): each
    request records the tokens it has in the step's journal and goes on. A restarted attempt that
    finds only those records (the job was killed right after) goes on from the tokens they hold."""
    from rft.explorer.journal import GenerationJournal

    engine, old, _ = engine_and_models
    engine.load_hf_dir(old, version=0)
    a_third_in = _a_third_in_s(engine)
    engine.journal = journal = GenerationJournal(str(tmp_path), rank=1, step=7)
    try:
        _generate_while_updating(engine, engine.keep_in_flight, a_third_in)
    finally:
        engine.journal = None
        journal.close()
    lines = [json.loads(line) for line in open(journal.path)]
    kept = [line for line in lines if line["completions"][0]["finish_reason"] == "abort"]
    assert len(kept) >= SAMPLES // 2 and all(0 < len(line["completions"][0]["token_ids"]) < TOKENS for line in kept)
    with open(journal.path, "w") as f:  # killed right after recording them: the finished records never came
        f.writelines(json.dumps(line) + "\n" for line in kept)

    engine.version = 3  # the restarted attempt serves newer weights' version
    resumed_before = engine.resumed
    engine.journal = GenerationJournal(str(tmp_path), rank=1, step=7)
    try:
        samples = _generate_while_updating(engine, None)
    finally:
        engine.journal.close()
        engine.journal = None
    assert engine.resumed - resumed_before == len(kept)
    prefixes = [line["completions"][0]["token_ids"] for line in kept]
    gone_on = [s for s in samples if any(s.token_ids[: len(p)] == p for p in prefixes)]
    assert len(gone_on) == len(kept)
    for sample in gone_on:
        assert len(sample.token_ids) == TOKENS and sample.versions[0] == 0 and sample.versions[-1] == 3
