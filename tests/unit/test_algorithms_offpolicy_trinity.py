"""Our REC, TOPR, sPPO, SAPO and REINFORCE losses against Trinity-RFT's own functions on the same
fixed tensors: the aggregated loss and its gradient d loss / d logprobs.

Trinity-RFT is no dependency of rft; tools/install_cpu.sh installs it (`--no-deps`) into .cache/peers,
out of the environment (it registers a vLLM plugin that needs Ray), so CI runs this file, and there
(CI=true) a missing Trinity-RFT fails it rather than skip it unseen. Elsewhere it is skipped unless
Trinity-RFT is in .cache/peers or importable; to run it without the install script:

    pip install --no-deps --target /tmp/trinity trinity-rft==0.6.0
    PYTHONPATH=/tmp/trinity pytest tests/unit/test_algorithms_offpolicy_trinity.py

Its policy losses (trinity/algorithm/policy_loss_fn/*.py) need only torch and two small modules
beside them (policy_loss_fn.py, utils.py, key_mapper.py), but importing them the usual way runs the
package's `trinity/algorithm/__init__.py`, which imports its advantage functions, buffer and
Ray. `trinity_losses` therefore loads those files under stand-in package modules (empty packages
whose __path__ is Trinity-RFT's directory, so no __init__ runs) and takes its stand-ins out of
sys.modules again: Trinity-RFT's code runs unchanged. Its advantage functions cannot be loaded so
(they import its Experience type, the buffer, Ray); test_algorithms_offpolicy.py checks ours
against their formulas by hand.

Trinity-RFT's losses reduce over the batch themselves (`loss_agg_mode`, token-mean by default) and
take advantages per token; ours return per-token losses that an aggregation reduces
(rft/algorithms/aggregation.py). Trinity-RFT adds 1e-8 to its token counts, hence the tolerance.
Known differences, asserted as such below: SAPO's gradient (Trinity-RFT stops the gradient through
its gate), TOPR's truncated ratio (Trinity-RFT: the token's; ours: the response's by default), the
"opmd" loss Trinity-RFT's AsymRE uses (our REINFORCE divided by 1 + tau).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import math
import os
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rft.algorithms.aggregation import AGGREGATIONS, batch_counts
from rft.algorithms.policy_losses import POLICY_LOSSES

LOSS_MODULES = ("rec_policy_loss", "topr_policy_loss", "sppo_loss_fn", "sapo_policy_loss", "opmd_policy_loss")


@pytest.fixture(scope="module")
def trinity() -> dict[str, types.ModuleType]:
    """Trinity-RFT's policy-loss modules, loaded without running its package __init__ files."""
    peers = Path(__file__).resolve().parents[2] / ".cache" / "peers"
    spec = importlib.machinery.PathFinder.find_spec("trinity", [str(peers)]) or importlib.util.find_spec("trinity")
    root = Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None
    if root is None or not (root / "algorithm" / "policy_loss_fn" / "rec_policy_loss.py").is_file():
        missing = "Trinity-RFT is not installed (pip install --no-deps trinity-rft==0.6.0: tools/install_cpu.sh)"
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail(missing)  # CI's install puts it there: a skip would hide a broken install step
        pytest.skip(missing)
    saved = {k: v for k, v in sys.modules.items() if k == "trinity" or k.startswith("trinity.")}
    try:
        for name, path in (("trinity", root), ("trinity.algorithm", root / "algorithm"),
                           ("trinity.algorithm.policy_loss_fn", root / "algorithm" / "policy_loss_fn")):
            package = types.ModuleType(name)
            package.__path__ = [str(path)]
            sys.modules[name] = package
        return {m: importlib.import_module(f"trinity.algorithm.policy_loss_fn.{m}") for m in LOSS_MODULES}
    finally:
        for name in [k for k in sys.modules if k == "trinity" or k.startswith("trinity.")]:
            del sys.modules[name]
        sys.modules.update(saved)


# ratios to the old policy, rows of A = +1, -2, 0 and -0.5, placed on both sides of every band
# (REC's [0.8, 1.2] and ring's [0.4, 3.0], sPPO's [1/1.3, 1.3]); the last row is half padding
RATIOS = [[1.1, 1.5, 0.5, 0.3, 1.25], [0.95, 0.7, 2.5, 3.5, 0.78], [1.0, 2.0, 0.6, 1.0, 1.0],
          [0.5, 0.9, 1.0, 1.0, 1.0]]
ADV = [1.0, -2.0, 0.0, -0.5]
MASK = [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
OLD = -1.0


def tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprobs with grad, old logprobs, advantages [B], mask); padding holds finite values, since
    Trinity-RFT's losses do not promise to ignore NaN there (ours do, tested elsewhere)."""
    logprobs = (torch.log(torch.tensor(RATIOS, dtype=torch.float64)) + OLD).requires_grad_()
    return logprobs, torch.full(logprobs.shape, OLD, dtype=torch.float64), torch.tensor(ADV, dtype=torch.float64), \
        torch.tensor(MASK, dtype=torch.float64)


def ours(name: str, agg: str = "token-mean", **cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """(aggregated loss, its gradient in the logprobs) of our loss `name`."""
    logprobs, old, adv, mask = tensors()
    per_token, _ = POLICY_LOSSES.get(name)(logprobs, old, adv, mask, SimpleNamespace(**cfg))
    num_tokens, num_seqs = batch_counts(mask)
    loss = AGGREGATIONS.get(agg)(per_token, mask, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=0)
    return loss.detach(), torch.autograd.grad(loss, logprobs)[0]


def theirs(fn) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, gradient) of a Trinity-RFT loss object, advantages passed per token as it takes them."""
    logprobs, old, adv, mask = tensors()
    loss, _ = fn(logprob=logprobs, old_logprob=old, action_mask=mask, advantages=adv[:, None] * mask)
    return loss.detach(), torch.autograd.grad(loss, logprobs)[0]


def assert_same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> None:
    torch.testing.assert_close(a[0], b[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(a[1], b[1], atol=1e-6, rtol=1e-6)
    assert (a[1] != 0).any()  # a comparison of two zeros would prove nothing


REC_VARIANTS = [(clip, weight) for clip in ("none", "one-side", "two-side", "ring")
                for weight in ("none", "importance_sampling")]


@pytest.mark.parametrize("clip, weight", REC_VARIANTS)
def test_rec_matches_trinity(trinity, clip, weight):
    fn = trinity["rec_policy_loss"].RECPolicyLossFn(epsilon_low=0.2, epsilon_high=0.2, epsilon_low_prime=0.6,
                                                    epsilon_high_prime=2.0, clip_mode=clip, weight=weight)
    assert_same(ours("rec", clip_eps=0.2, rec_clip=clip, rec_importance_sampling=weight != "none",
                     rec_ring_eps_low=0.6, rec_ring_eps_high=2.0), theirs(fn))  # its REC is token-mean only


def test_topr_per_token_matches_trinity(trinity):
    fn = trinity["topr_policy_loss"].TOPRPolicyLossFn()  # threshold 0, token-mean
    assert_same(ours("topr", topr_ratio="token"), theirs(fn))


def test_topr_per_response_is_the_papers_and_not_trinitys(trinity):
    """Row 3 (A = -0.5, ratios 0.5 and 0.9): Trinity-RFT weights its tokens 0.5 and 0.9, the paper
    (our default) both by the response's 0.45."""
    _, grad = ours("topr")
    _, trinity_grad = theirs(trinity["topr_policy_loss"].TOPRPolicyLossFn())
    tokens = sum(map(sum, MASK))
    torch.testing.assert_close(grad[3, :2], torch.tensor([0.45, 0.45], dtype=torch.float64) * 0.5 / tokens)
    torch.testing.assert_close(trinity_grad[3, :2], torch.tensor([0.5, 0.9], dtype=torch.float64) * 0.5 / tokens)


def test_sppo_matches_trinity(trinity):
    assert_same(ours("sppo", sppo_eps=0.3), theirs(trinity["sppo_loss_fn"].sPPOPolicyLossFn(epsilon=0.3)))


def test_reinforce_is_trinitys_opmd_loss_without_its_regulariser_scale(trinity):
    """Trinity-RFT's AsymRE trains with its "opmd" loss, -A log pi / (1 + tau): tau = 0 is our
    REINFORCE; its default tau = 1 halves it (the paper's AsymRE loss has no such factor)."""
    opmd = trinity["opmd_policy_loss"].OPMDPolicyLossFn
    assert_same(ours("reinforce"), theirs(opmd(tau=0.0)))
    loss, grad = ours("reinforce")
    halved = theirs(opmd(tau=1.0))
    torch.testing.assert_close((loss / 2, grad / 2), halved)


def test_sapo_value_matches_the_gate_but_the_gradient_is_the_papers(trinity):
    """Trinity-RFT's SAPO loss is -A sg(f(r)) log pi: its gradient weight is f(r) = (4 / tau)
    sigmoid(tau (r - 1)), 2 / tau on policy. The paper's objective -A f(r), ours, has the weight
    f'(r) r = 4 s (1 - s) r, 1 on policy. Both, token by token, from the code that ran."""
    _, grad = ours("sapo", "seq-mean-token-mean")
    _, trinity_grad = theirs(trinity["sapo_policy_loss"].SAPOPolicyLossFn(loss_agg_mode="seq-mean-token-mean"))
    lengths = [sum(row) for row in MASK]
    for i, (row, a, mrow) in enumerate(zip(RATIOS, ADV, MASK)):
        tau = 1.0 if a > 0 else 1.05
        for t, (r, m) in enumerate(zip(row, mrow)):
            s = 1 / (1 + math.exp(-tau * (r - 1)))
            scale = m / lengths[i] / len(MASK)  # seq-mean-token-mean's weight of this token
            assert grad[i, t].item() == pytest.approx(-a * 4 * s * (1 - s) * r * scale, abs=1e-9)
            assert trinity_grad[i, t].item() == pytest.approx(-a * 4 / tau * s * scale, abs=1e-9)
    assert not torch.allclose(grad, trinity_grad)
