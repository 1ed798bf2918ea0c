"""The trainer's tensors as layout-free checkpoint entries, so that a run saved at one TP x PP x DP
layout resumes at another.

megatron-core's `sharded_state_dict` gives each tensor of a model shard its key, shape and offset
in the whole model (TP splits, the fused QKV and gate/up, PP layer offsets), and
`megatron.core.dist_checkpointing` saves and loads by those (rft/runtime/state.py calls it for
every component with `checkpoint_shards`). An optimizer's per-parameter tensors (fp32 masters,
Adam's moments) take their parameter's place under a prefix of their own, as megatron-core's
optimizers do.

`checkpoint_shards(prefix, loading)` returns a nested dict shaped like the component's
`state_dict()` with sharded tensors where the tensors go (`loading`: as the template to load
into), or None where the component cannot be resharded (it is then saved whole in its rank's
file). What dist_checkpointing loads back has that shape with
plain tensors, so the component's `load_state_dict` takes it. Values that are not tensors (a loss
scale, a step count) are saved once, from trainer rank 0.
"""

from __future__ import annotations

from typing import Any

from rft.trainer.chunks import named_chunks


def _unprefixed(state: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {key[len(prefix):] if key.startswith(prefix) else key: value for key, value in state.items()}


def sharded_parameters(model) -> dict[str, Any]:
    """model.named_parameters() name -> the sharded tensor (or factory) megatron-core gives it,
    keyed by its place in the whole model."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    by_data = {}
    for _, chunk in named_chunks(model):
        sharded, _ = extract_sharded_tensors_and_factories(chunk.sharded_state_dict())
        by_data.update({id(t.data): t for t in nested_values(sharded)})
    found = {name: by_data.get(id(p)) for name, p in model.named_parameters()}
    missing = [name for name, t in found.items() if t is None]
    assert not missing, f"megatron-core gave no sharded tensor for {missing[:3]}"
    return found


def in_place_of(parameter: Any, tensor: Any, prefix: str) -> Any:
    """`tensor` (an fp32 master, an Adam moment) in `parameter`'s place in the whole model."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    return make_sharded_optimizer_tensor(parameter, tensor, prefix.rstrip("."))


def local_only(value: Any) -> Any:
    """A value each rank keeps its own of (an optimizer's parameter indices): never saved."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

    return LocalNonpersistentObject(value)


class ShardedModel:
    """A trainer model (the policy, or the frozen reference) as a checkpoint component: a
    GPTModel, or a pipeline stage's VirtualStages (one entry per chunk)."""

    def __init__(self, model):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return self.model.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        chunks = named_chunks(self.model)
        if set(state) == {str(v) for v in range(len(chunks))}:  # what dist_checkpointing loaded
            for v, (_, chunk) in enumerate(chunks):
                chunk.load_state_dict(state[str(v)])
        else:  # a rank file from before sharded checkpoints
            self.model.load_state_dict(state)

    def checkpoint_shards(self, prefix: str, loading: bool = False) -> dict[str, Any]:
        # the tensors' keys carry the prefix (what dist_checkpointing matches); each chunk's dict
        # keeps the chunk's own parameter names (what its load_state_dict takes)
        return {str(v): _unprefixed(chunk.sharded_state_dict(prefix=prefix), prefix)
                for v, (_, chunk) in enumerate(named_chunks(self.model))}
