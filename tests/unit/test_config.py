"""Config composition and validation: bad values name the key and the fix; unknown keys fail."""

import os

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from rft.config import RFTConfig, register_configs, stage_configs, validate

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


@pytest.mark.parametrize("override, key", [
    ("algorithm.group_size=1", "algorithm.group_size"),
    ("algorithm.clip_eps=1.5", "algorithm.clip_eps"),
    ("algorithm.reward=bleu", "algorithm.reward"),
    ("model.dtype=int8", "model.dtype"),
    ("buffer.format=csv", "buffer.format"),
    ("trainer.tensor_parallel_size=3", "trainer.tensor_parallel_size"),
])
def test_bad_values_name_the_key(tmp_path, override, key):
    cfg = compose_cfg("+experiment=gsm8k_grpo", "model=smollm2_135m", f"run.output_dir={tmp_path}",
                      f"model.path={tmp_path}", override)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        validate(cfg)


def test_missing_model_path_says_how_to_fix(tmp_path):
    cfg = compose_cfg("+experiment=gsm8k_grpo", "model=smollm2_135m", f"model.path={tmp_path}/nope")
    with pytest.raises(ValueError, match=r"model\.path.*prepare_smollm2"):
        validate(cfg)


def test_missing_dataset_file_names_the_key(tmp_path):
    (tmp_path / "config.json").write_text("{}")
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
