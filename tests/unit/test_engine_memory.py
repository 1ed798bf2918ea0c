"""What memory each vLLM engine is given (rft/explorer/vllm_engine.py's memory_kwargs), on CPU and
on GPUs, and what the plan says about it. vLLM's rule, vllm/config/cache.py: `kv_cache_memory_bytes`
"(when not-None) ignores gpu_memory_utilization" when sizing the cache."""

import pytest

from rft.config import RolloutConfig
from rft.config.checks import validate
from rft.explorer.vllm_engine import memory_kwargs
from tests.unit.test_config import compose_cfg

GIB = 2**30


def test_on_gpus_the_share_sizes_the_cache_unless_kv_cache_gb_is_set():
    assert memory_kwargs(RolloutConfig(gpu_memory_utilization=0.6), on_gpu=True) == {"gpu_memory_utilization": 0.6}
    # set: honoured on GPUs as on CPU (it once was dropped on GPUs without a word)
    assert memory_kwargs(RolloutConfig(kv_cache_gb=4.0, gpu_memory_utilization=0.6), on_gpu=True) == \
        {"gpu_memory_utilization": 0.6, "kv_cache_memory_bytes": 4 * GIB}


def test_on_cpu_the_cache_is_always_sized_never_a_share_of_the_nodes_ram():
    assert memory_kwargs(RolloutConfig(), on_gpu=False) == {"kv_cache_memory_bytes": 1 * GIB}
    assert memory_kwargs(RolloutConfig(kv_cache_gb=0.25), on_gpu=False) == {"kv_cache_memory_bytes": GIB // 4}


@pytest.mark.parametrize("key", ["rollout.kv_cache_gb", "judge.kv_cache_gb"])
def test_a_cache_of_no_memory_is_refused_naming_the_key(key):
    with pytest.raises(ValueError, match=rf"{key}=0\.0 is invalid: use a positive number of GiB"):
        validate(compose_cfg("+experiment=quickstart", f"{key}=0", "cluster.judge_ranks=1"))
