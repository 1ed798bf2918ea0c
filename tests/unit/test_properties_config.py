"""Property-based tests (Hypothesis) of config validation: a value drawn from a key's bad range
(a negative or zero size, an out-of-range ratio, an unknown choice) makes `validate` raise the
config error (ValueError) naming that key, never another exception; a value from its good range
passes. The base is the quickstart's config without stages (the tiny model and its arithmetic data
are generated, so no file is needed)."""

from __future__ import annotations

import copy
import math
import os
import tempfile

import pytest
from hydra import compose, initialize_config_dir
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from rft.config import RFTConfig, register_configs
from rft.config.checks import validate

CONF = os.path.join(os.path.dirname(__file__), "..", "..", "conf")
FAST = settings(max_examples=40, deadline=None, database=None)


@pytest.fixture(scope="module")
def base() -> RFTConfig:
    register_configs()
    with initialize_config_dir(config_dir=os.path.abspath(CONF), version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="config", overrides=[
            "+experiment=quickstart", f"run.output_dir={tempfile.gettempdir()}/rft-properties"]))
    cfg.stages = []  # the top-level sections are the one stage, so every key below is checked
    validate(cfg)
    return cfg


def at_most(n: int) -> st.SearchStrategy[int]:
    return st.just(n) | st.integers(max_value=n)  # the boundary itself half the time


def word(known: tuple[str, ...]) -> st.SearchStrategy[str]:
    return st.text(max_size=12).filter(lambda s: s not in known)


# key -> (bad values, good values)
RANGES = {
    "cluster.trainer_ranks": (at_most(0), st.just(1)),
    "trainer.micro_batch_size": (at_most(0), st.integers(1, 4096)),
    "trainer.max_steps": (at_most(-1), st.integers(0, 10**6)),
    "trainer.max_tokens_per_microbatch": (at_most(-1), st.integers(0, 10**6)),
    "trainer.save_interval": (at_most(-1), st.integers(0, 10**4)),
    "trainer.keep_checkpoints": (at_most(0), st.integers(1, 100)),
    "trainer.lora.rank": (at_most(-1), st.just(0)),
    "trainer.loss_scale": (st.floats(max_value=0), st.none() | st.floats(min_value=1e-30, max_value=1e30)),
    "trainer.recompute": (word(("none", "selective", "full")), st.sampled_from(["none", "selective", "full"])),
    "rollout.tasks_per_step": (at_most(0), st.integers(1, 10**4)),
    # the tiny model's context is 64 tokens (max_position_embeddings)
    "rollout.max_new_tokens": (at_most(0) | st.integers(64, 10**6), st.integers(1, 63)),
    "rollout.max_sampling_rounds": (at_most(0), st.integers(1, 100)),
    "algorithm.group_size": (at_most(1), st.integers(2, 256)),
    "algorithm.clip_eps": (st.floats(max_value=0) | st.floats(min_value=1), st.floats(1e-6, 1, exclude_max=True)),
    "algorithm.lr": (st.floats(max_value=0), st.floats(1e-12, 10)),
    "algorithm.critic_lr": (st.floats(max_value=0), st.floats(1e-12, 10)),
    "algorithm.min_lr_ratio": (st.floats(max_value=0, exclude_max=True) | st.floats(min_value=1, exclude_min=True),
                               st.floats(0, 1)),
    "algorithm.ppo_epochs": (at_most(0), st.integers(1, 8)),
    "algorithm.mini_batch_size": (at_most(-1), st.integers(0, 4096)),
    "algorithm.dual_clip_c": (st.floats(max_value=1), st.none() | st.floats(1, 100, exclude_min=True)),
    "algorithm.lr_decay": (word(("constant", "cosine", "linear")), st.sampled_from(["constant", "cosine", "linear"])),
    "algorithm.kl_mode": (word(("loss", "reward")), st.just("loss")),
    "data.overlong": (word(("skip", "truncate_left", "error")), st.sampled_from(["skip", "truncate_left", "error"])),
    "model.max_seq_len": (at_most(1), st.integers(64, 10**6)),
    "model.dtype": (word(("float32", "bfloat16", "float16")), st.sampled_from(["float32", "bfloat16", "float16"])),
    "sync.interval": (at_most(0), st.integers(1, 100)),
    "sync.offset": (at_most(-1), st.integers(0, 100)),
    "sync.bucket_mb": (at_most(0), st.integers(1, 4096)),
    "sync.engine": (word(("auto", "nccl", "gloo", "checkpoint")), st.sampled_from(["auto", "gloo", "checkpoint"])),
    "buffer.max_staleness": (at_most(-1), st.none() | st.integers(0, 100)),
    "buffer.stale": (word(("drop", "reweight")), st.sampled_from(["drop", "reweight"])),
    "buffer.format": (word(("parquet", "arrow")), st.sampled_from(["parquet", "arrow"])),
    "cluster.kind": (word(("auto", "local", "slurm")), st.sampled_from(["auto", "local", "slurm"])),
    "cluster.max_requeues": (at_most(-1), st.integers(0, 100)),
    "run.resume": (word(("auto", "require", "never")), st.sampled_from(["auto", "require", "never"])),
    "mode": (word(("both", "train", "explore", "serve", "bench")), st.just("both")),
}
# NaN passed every range check above (`nan <= 0` is False) until validate refused non-finite numbers
FLOAT_KEYS = ("algorithm.lr", "algorithm.critic_lr", "algorithm.clip_eps_high", "algorithm.tis_cap",
              "algorithm.value_clip", "algorithm.dual_clip_c", "algorithm.kl_coef", "trainer.loss_scale",
              "rollout.temperature", "rollout.task_timeout_s", "sync.timeout_s")


def with_value(cfg: RFTConfig, key: str, value) -> RFTConfig:
    cfg = copy.deepcopy(cfg)
    *sections, name = key.split(".")
    owner = cfg
    for section in sections:
        owner = getattr(owner, section)
    assert hasattr(owner, name), key  # a renamed key must not turn this test into a no-op
    setattr(owner, name, value)
    return cfg


@st.composite
def good_settings(draw) -> list[tuple[str, object]]:
    keys = draw(st.lists(st.sampled_from(sorted(RANGES)), unique=True, max_size=6))
    return [(key, draw(RANGES[key][1])) for key in keys]


@pytest.mark.parametrize("key", sorted(RANGES))
@settings(max_examples=6, deadline=None, database=None)
@given(data=st.data())
def test_a_value_from_a_bad_range_raises_the_config_error_naming_its_key(base, key, data):
    value = data.draw(RANGES[key][0], label=key)
    with pytest.raises(ValueError) as err:
        validate(with_value(base, key, value))
    assert str(err.value).startswith(f"{key}={value!r} is invalid: ")


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_number_that_is_not_finite_raises_the_config_error_naming_its_key(base, key, value):
    with pytest.raises(ValueError) as err:
        validate(with_value(base, key, value))
    assert str(err.value).startswith(f"{key}={value!r} is invalid: ")


@FAST
@given(settings_=good_settings())
def test_values_from_good_ranges_pass(base, settings_):
    cfg = base
    for key, value in settings_:
        cfg = with_value(cfg, key, value)
    validate(cfg)
