"""Algorithm zoo registries: lookup errors, user functions by dotted path, signature checks, and a
contract test that calls every built-in of every registry on a small random batch."""

import math

import pytest
import torch

from rft.algorithms.advantages import ADVANTAGES, AdvantageInputs, AdvantageOutputs
from rft.algorithms.aggregation import AGGREGATIONS, batch_counts
from rft.algorithms.filters import SAMPLE_FILTERS
from rft.algorithms.kl import KL_ESTIMATORS
from rft.algorithms.policy_losses import POLICY_LOSSES
from rft.registry import Registry

ALL_REGISTRIES = [ADVANTAGES, POLICY_LOSSES, KL_ESTIMATORS, AGGREGATIONS, SAMPLE_FILTERS]


# --- user functions that the tests import by dotted path ----------------------------------------

def halved_k1(logprobs, ref_logprobs):
    """A user KL estimator with the right signature."""
    return 0.5 * (logprobs - ref_logprobs)


def kl_with_wrong_names(logprobs, reference, temperature):
    return logprobs - reference


def kl_with_swapped_order(ref_logprobs, logprobs):
    return logprobs - ref_logprobs


def kl_with_optional_extra(logprobs, ref_logprobs, scale: float = 1.0):
    return scale * (logprobs - ref_logprobs)


def agg_without_star(per_token, mask, num_tokens, num_seqs, norm_len):
    """Keyword-only parameters may also be plain parameters: keywords still reach them."""
    return per_token.sum()


def agg_missing_keyword(per_token, mask, *, num_tokens):
    return per_token.sum()


def agg_with_kwargs(per_token, mask, **kwargs):
    return per_token.sum()


NOT_A_FUNCTION = 3


def path(name: str) -> str:
    return f"{__name__}.{name}"


# --- lookup -------------------------------------------------------------------------------------

@pytest.mark.parametrize("registry", ALL_REGISTRIES, ids=lambda r: r.kind)
def test_unknown_name_names_the_registry_and_lists_known_names(registry):
    with pytest.raises(ValueError) as err:
        registry.get("no_such_thing")
    message = str(err.value)
    assert f"unknown {registry.kind} 'no_such_thing'" in message
    for name in registry.names():
        assert name in message
    assert registry.signature in message


def test_resolve_unknown_plain_name_lists_known_names():
    # every built-in, sorted (modules beyond advantages.py register some: rft/algorithms/__init__.py)
    assert {"asymre", "dr_grpo", "gae", "grpo", "grpo_per_turn", "reinforce", "reinforce_pp", "rloo"} <= set(ADVANTAGES.names())
    with pytest.raises(ValueError, match="known: " + ", ".join(ADVANTAGES.names()) + r"\."):
        ADVANTAGES.resolve("gpro")


def test_builtins_are_resolved_by_name():
    assert KL_ESTIMATORS.resolve("k3") is KL_ESTIMATORS.get("k3")
    assert "k3" in KL_ESTIMATORS and "k4" not in KL_ESTIMATORS


def test_registry_register_get_and_duplicates():
    reg = Registry("widget", params=("x",))

    @reg.register("double")
    def double(x):
        return 2 * x

    assert reg.get("double")(3) == 6
    assert reg.names() == ["double"]
    with pytest.raises(ValueError, match="widget 'double' is already registered"):
        reg.register("double")(double)


def test_register_rejects_a_builtin_with_the_wrong_signature():
    reg = Registry("widget", params=("x", "cfg"))
    with pytest.raises(ValueError, match=r"built-in widget 'bad'.*missing parameters: cfg"):
        reg.register("bad")(lambda x: x)


# --- dotted paths -------------------------------------------------------------------------------

def test_dotted_path_imports_a_user_function():
    fn = KL_ESTIMATORS.resolve(path("halved_k1"))
    assert fn is halved_k1
    assert fn(torch.tensor([1.0]), torch.tensor([0.0])).item() == 0.5


def test_resolve_accepts_a_callable_after_checking_it():
    assert KL_ESTIMATORS.resolve(halved_k1) is halved_k1
    with pytest.raises(ValueError, match="missing parameters: ref_logprobs"):
        KL_ESTIMATORS.resolve(kl_with_wrong_names)


def test_signature_mismatch_names_path_parameters_and_expected_signature():
    spec = path("kl_with_wrong_names")
    with pytest.raises(ValueError) as err:
        KL_ESTIMATORS.resolve(spec)
    message = str(err.value)
    assert f"KL estimator '{spec}'" in message
    assert "(logprobs, reference, temperature)" in message
    assert "missing parameters: ref_logprobs" in message
    assert "unexpected required parameters: reference, temperature" in message
    assert "fn(logprobs, ref_logprobs) -> per-token KL [B, T]" in message


def test_signature_with_parameters_in_the_wrong_order_is_rejected():
    with pytest.raises(ValueError, match=r"positional parameters start \(ref_logprobs, logprobs\), "
                                         r"expected \(logprobs, ref_logprobs\)"):
        KL_ESTIMATORS.resolve(path("kl_with_swapped_order"))


def test_optional_extra_parameters_and_plain_keyword_parameters_are_accepted():
    assert KL_ESTIMATORS.resolve(path("kl_with_optional_extra")) is kl_with_optional_extra
    assert AGGREGATIONS.resolve(path("agg_without_star")) is agg_without_star
    assert AGGREGATIONS.resolve(path("agg_with_kwargs")) is agg_with_kwargs


def test_missing_keyword_only_parameters_are_named():
    with pytest.raises(ValueError, match="missing parameters: num_seqs, norm_len"):
        AGGREGATIONS.resolve(path("agg_missing_keyword"))


def test_dotted_path_to_a_missing_module_or_attribute_or_a_non_function():
    with pytest.raises(ValueError, match="cannot import module 'no_such_pkg_xyz.losses'"):
        POLICY_LOSSES.resolve("no_such_pkg_xyz.losses.my_loss")
    with pytest.raises(ValueError, match=f"module '{__name__}' has no attribute 'nothing_here'"):
        POLICY_LOSSES.resolve(path("nothing_here"))
    with pytest.raises(ValueError, match="is a int, not a function"):
        POLICY_LOSSES.resolve(path("NOT_A_FUNCTION"))


def test_a_stdlib_function_with_other_parameters_is_rejected():
    with pytest.raises(ValueError, match=r"'math.sqrt' has signature \(x, /\)"):
        KL_ESTIMATORS.resolve("math.sqrt")
    assert math.sqrt(4) == 2  # the import above is the real module, untouched


# --- contract: every built-in runs on a small random batch --------------------------------------

B, T, GROUP = 6, 5, 3


def random_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 3, 1, 4, 2, 5])  # right padding, one length-1 response
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()
    batch = {
        "values": torch.randn(B, T, generator=g),
        "logprobs": -torch.rand(B, T, generator=g) * 3,
        "old_logprobs": -torch.rand(B, T, generator=g) * 3,
        "ref_logprobs": -torch.rand(B, T, generator=g) * 3,
        "advantages": torch.randn(B, T, generator=g),
    }
    for t in batch.values():  # padding holds garbage; no built-in may let it through
        t[mask == 0] = float("nan")
    return {**batch, "mask": mask, "rewards": torch.randint(0, 2, (B,), generator=g).float()}


def all_builtins():
    return [pytest.param(reg, name, id=f"{reg.kind}:{name}") for reg in ALL_REGISTRIES for name in reg.names()]


def test_every_registry_has_builtins():
    assert all(reg.names() for reg in ALL_REGISTRIES)


@pytest.mark.parametrize("registry,name", all_builtins())
def test_every_builtin_runs_on_a_random_batch(registry, name):
    batch = random_batch()
    mask = batch["mask"]
    fn = registry.resolve(name)
    if registry is ADVANTAGES:
        inputs = AdvantageInputs(batch["rewards"], torch.arange(B) // GROUP, mask, values=batch["values"])
        if ADVANTAGES.meta(fn).get("needs_teacher"):  # distillation: the student's and a teacher's logprobs
            inputs.old_logprobs, inputs.teacher_logprobs = batch["old_logprobs"], batch["ref_logprobs"]
        out = fn(inputs, None)
        assert isinstance(out, AdvantageOutputs)
        assert out.advantages.shape == (B, T) and torch.isfinite(out.advantages).all()
        assert (out.advantages[mask == 0] == 0).all()
        assert out.returns is None or (out.returns.shape == (B, T) and torch.isfinite(out.returns).all())
    elif registry is POLICY_LOSSES:
        logprobs = batch["logprobs"].clone().requires_grad_()
        loss, metrics = fn(logprobs, batch["old_logprobs"], batch["advantages"], mask, None)
        assert loss.shape == (B, T) and torch.isfinite(loss).all()
        assert (loss[mask == 0] == 0).all()
        assert all(v.dim() == 0 and torch.isfinite(v) and not v.requires_grad for v in metrics.values())
        loss.sum().backward()
        assert torch.isfinite(logprobs.grad).all() and (logprobs.grad[mask == 0] == 0).all()
    elif registry is KL_ESTIMATORS:  # elementwise: the caller masks
        kl = fn(batch["logprobs"], batch["ref_logprobs"])
        assert kl.shape == (B, T) and torch.isfinite(kl[mask == 1]).all()
    elif registry is AGGREGATIONS:
        num_tokens, num_seqs = batch_counts(mask)
        value = fn(batch["advantages"], mask, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=T)
        assert value.dim() == 0 and torch.isfinite(value)
    elif registry is SAMPLE_FILTERS:
        keep = fn(batch["rewards"], torch.arange(B) // GROUP)
        assert keep.shape == (B,) and keep.dtype == torch.bool
    else:  # a new registry must get a branch here
        raise AssertionError(f"no contract check for {registry.kind}")
