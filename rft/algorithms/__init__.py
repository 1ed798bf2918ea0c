"""The algorithm zoo: registries of advantage estimators, policy losses, KL estimators, loss
aggregations and sample filters (one module each); `registries()` maps AlgorithmConfig keys to them.
Modules that add built-ins to a registry beyond its own module's are imported at the end, so every
user of a registry sees them."""

from __future__ import annotations

from rft.registry import Registry


def registries() -> dict[str, Registry]:
    """AlgorithmConfig key -> the registry its value is looked up in."""
    from rft.algorithms.advantages import ADVANTAGES
    from rft.algorithms.aggregation import AGGREGATIONS
    from rft.algorithms.filters import SAMPLE_FILTERS
    from rft.algorithms.kl import KL_ESTIMATORS
    from rft.algorithms.policy_losses import POLICY_LOSSES

    return {"advantage": ADVANTAGES, "policy_loss": POLICY_LOSSES, "kl_estimator": KL_ESTIMATORS,
            "loss_agg": AGGREGATIONS, "sample_filter": SAMPLE_FILTERS}


# per-turn credit registers "grpo_per_turn" in ADVANTAGES (it imports advantages.py, not the reverse)
from rft.algorithms import turn_credit  # noqa: E402,F401
# the off-policy REINFORCE family registers rec, topr, sppo, sapo, reinforce in POLICY_LOSSES and
# asymre, reinforce in ADVANTAGES (it imports the registries' modules, not the reverse)
from rft.algorithms import offpolicy  # noqa: E402,F401
# on-policy distillation registers on_policy_distill and jsd in ADVANTAGES (needs_teacher=True)
from rft.algorithms import distillation  # noqa: E402,F401
