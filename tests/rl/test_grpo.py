"""GRPO tensor functions against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rl.grpo import (
    entropy_from_logits,
    group_advantages,
    kl_k3,
    policy_loss,
    token_logprobs,
)


def _leaf(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def _assert_values(actual: torch.Tensor, expected: list, atol: float = 1e-6) -> None:
    expected_tensor = torch.tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual.detach(), expected_tensor, atol=atol, rtol=1e-6)


# --- advantages -------------------------------------------------------------------------------


def test_group_advantages_normalised_by_population_std() -> None:
    # mean 0.5, population std 0.5 -> (r - 0.5) / 0.5
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    _assert_values(adv, [[1.0, -1.0, -1.0, 1.0]], atol=1e-5)


def test_group_advantages_flat_with_group_size_keeps_shape() -> None:
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0]), group_size=2)
    assert adv.shape == (6,)
    assert adv.tolist() == pytest.approx([1, -1, -1, 1, 1, -1], abs=1e-5)


def test_group_advantages_eps_is_in_the_denominator() -> None:
    adv = group_advantages(torch.tensor([[1.0, 0.0]]), eps=0.5)
    _assert_values(adv, [[0.5, -0.5]])  # 0.5 / (0.5 + 0.5)


def test_group_advantages_mean_only() -> None:
    adv = group_advantages(torch.tensor([[3.0, 1.0, 2.0]]), normalize_std=False)
    _assert_values(adv, [[1.0, -1.0, 0.0]])


def test_constant_group_gets_zero_advantage() -> None:
    rewards = torch.tensor([[0.3, 0.3, 0.3], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    adv = group_advantages(rewards)
    assert adv[:2].tolist() == [[0.0] * 3, [0.0] * 3]
    assert adv[2].abs().sum() > 0


def test_group_advantages_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(4))
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(torch.zeros(4), group_size=3)
    with pytest.raises(ValueError, match="contradicts"):
        group_advantages(torch.zeros(2, 4), group_size=2)


# --- kl, entropy, log-probs -------------------------------------------------------------------


def test_kl_k3_zero_at_equal_logps_and_hand_value() -> None:
    logp = torch.tensor([-1.0, -2.0])
    assert kl_k3(logp, logp).tolist() == [0.0, 0.0]
    # ref - logp = log 2 -> 2 - log 2 - 1
    value = kl_k3(torch.tensor([0.0]), torch.tensor([math.log(2.0)]))
    assert value.item() == pytest.approx(1.0 - math.log(2.0))
    assert (kl_k3(torch.randn(100), torch.randn(100)) >= 0).all()


def test_entropy_uniform_and_peaked() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]])
    entropy = entropy_from_logits(logits)
    assert entropy.tolist() == pytest.approx([math.log(4.0), 0.0], abs=1e-6)


def test_token_logprobs_with_temperature() -> None:
    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # probs 1/4, 3/4
    targets = torch.tensor([[1]])
    assert token_logprobs(logits, targets).item() == pytest.approx(math.log(0.75))
    # temperature 0.5 doubles the logits: probs 1/10, 9/10
    assert token_logprobs(logits, targets, temperature=0.5).item() == pytest.approx(math.log(0.9))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, targets, temperature=0.0)
    with pytest.raises(ValueError, match="leading dimensions"):
        token_logprobs(logits, torch.tensor([1]))


# --- policy loss ------------------------------------------------------------------------------


def test_on_policy_gradient_is_minus_advantage_over_token_count() -> None:
    logp = _leaf([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = torch.tensor([2.0, -1.0], dtype=torch.float64)
    loss, metrics = policy_loss(logp, logp.detach(), adv, mask)
    loss.backward()
    n = 5
    expected = [[-2 / n, -2 / n, -2 / n], [1 / n, 1 / n, 0.0]]
    _assert_values(logp.grad, expected)
    assert metrics["ratio_mean"] == pytest.approx(1.0)
    assert metrics["clip_fraction"] == 0.0
    assert metrics["loss"] == pytest.approx((-2 * 3 + 1 * 2) / n)


def test_metrics_are_detached_0_dim_tensors() -> None:
    """Metrics stay 0-dim tensors (no host sync per micro-batch), detached from the graph."""
    logp = _leaf([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    for ref_logp in (None, ref):
        _, metrics = policy_loss(
            logp, logp.detach(), torch.ones(1, dtype=torch.float64), torch.ones(1, 2), ref_logp=ref_logp
        )
        assert sorted(metrics) == [
            "clip_fraction",
            "is_truncated_fraction",
            "is_weight_deviation",
            "is_weight_mean",
            "kl",
            "loss",
            "policy_loss",
            "ratio_mean",
        ]
        for name, value in metrics.items():
            assert isinstance(value, torch.Tensor) and value.dim() == 0, name
            assert not value.requires_grad and value.device == logp.device, name


def test_token_and_sequence_aggregation_differ_for_unequal_lengths() -> None:
    logp = _leaf([[-1.0, 0.0, 0.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    adv = torch.tensor([2.0, -1.0], dtype=torch.float64)
    token, _ = policy_loss(logp, logp.detach(), adv, mask, aggregation="token")
    sequence, _ = policy_loss(logp, logp.detach(), adv, mask, aggregation="sequence")
    assert token.item() == pytest.approx((-2.0 + 3 * 1.0) / 4)  # 0.25
    assert sequence.item() == pytest.approx((-2.0 + 1.0) / 2)  # -0.5
    sequence.backward()
    _assert_values(logp.grad, [[-1.0, 0.0, 0.0], [1 / 6, 1 / 6, 1 / 6]])


@pytest.mark.parametrize(
    ("log_ratio", "advantage", "clipped"),
    [
        (math.log(1.5), 1.0, True),  # ratio above 1 + eps, positive advantage
        (math.log(0.5), -1.0, True),  # ratio below 1 - eps, negative advantage
        (math.log(1.5), -1.0, False),  # above the band, but the unclipped term is the min
        (math.log(0.5), 1.0, False),
        (math.log(1.1), 1.0, False),  # inside the band
    ],
)
def test_clipping_zeroes_gradient_outside_band(log_ratio: float, advantage: float, clipped: bool) -> None:
    old = torch.tensor([[-1.0]], dtype=torch.float64)
    logp = _leaf([[-1.0 + log_ratio]])
    adv = torch.tensor([advantage], dtype=torch.float64)
    loss, metrics = policy_loss(logp, old, adv, torch.ones(1, 1), clip_eps=0.2)
    loss.backward()
    ratio = math.exp(log_ratio)
    if clipped:
        assert logp.grad.item() == 0.0
        assert metrics["clip_fraction"] == 1.0
        bound = 1.2 if advantage > 0 else 0.8
        assert loss.item() == pytest.approx(-bound * advantage)
    else:
        assert logp.grad.item() == pytest.approx(-advantage * ratio)
        assert metrics["clip_fraction"] == 0.0
        assert loss.item() == pytest.approx(-ratio * advantage)
    assert metrics["ratio_mean"] == pytest.approx(ratio)


def test_clip_eps_high_widens_upper_bound_only() -> None:
    old = torch.zeros(1, 1, dtype=torch.float64)
    logp = _leaf([[math.log(1.25)]])
    adv = torch.tensor([1.0], dtype=torch.float64)
    loss, metrics = policy_loss(logp, old, adv, torch.ones(1, 1), clip_eps_high=0.28)
    loss.backward()
    assert metrics["clip_fraction"] == 0.0
    assert logp.grad.item() == pytest.approx(-1.25)


def test_masked_tokens_contribute_nothing() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv = torch.tensor([1.0, -0.5], dtype=torch.float64)
    inf, nan = float("inf"), float("nan")
    old = torch.tensor([[-1.0, -1.0, -inf], [-2.0, nan, 5.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -0.5, nan], [-1.0, 3.0, inf]], dtype=torch.float64)
    base = [[-0.9, -1.2, 0.0], [-2.1, 0.0, 0.0]]
    garbage = [[-0.9, -1.2, 50.0], [-2.1, -inf, 7.0]]
    results = []
    for values in (base, garbage):
        logp = _leaf(values)
        loss, metrics = policy_loss(logp, old, adv, mask, kl_coef=0.1, ref_logp=ref, aggregation="sequence")
        loss.backward()
        results.append((loss.item(), {key: value.item() for key, value in metrics.items()}, logp.grad))
    (loss_a, metrics_a, grad_a), (loss_b, metrics_b, grad_b) = results
    assert math.isfinite(loss_a) and loss_a == pytest.approx(loss_b)
    assert metrics_a == pytest.approx(metrics_b)
    assert torch.equal(grad_a, grad_b)
    assert grad_a[0, 2] == 0 and grad_a[1, 1] == 0 and grad_a[1, 2] == 0


def test_kl_term_added_with_coefficient_and_reported() -> None:
    logp = _leaf([[0.0, 0.0]])
    ref = torch.tensor([[math.log(2.0), 0.0]], dtype=torch.float64)
    adv = torch.tensor([1.0], dtype=torch.float64)
    k3 = 1.0 - math.log(2.0)
    loss, metrics = policy_loss(logp, logp.detach(), adv, torch.ones(1, 2), kl_coef=0.5, ref_logp=ref)
    assert metrics["kl"] == pytest.approx(k3 / 2)
    assert metrics["policy_loss"] == pytest.approx(-1.0)
    assert loss.item() == pytest.approx(-1.0 + 0.5 * k3 / 2)
    assert metrics["loss"] == pytest.approx(loss.item())
    loss.backward()
    # d k3 / d logp = 1 - exp(ref - logp) = -1 at the first token, 0 at the second
    _assert_values(logp.grad, [[(-1.0 + 0.5 * -1.0) / 2, -1.0 / 2]])


def test_kl_reported_without_entering_loss_when_coef_zero() -> None:
    logp = _leaf([[0.0]])
    ref = torch.tensor([[math.log(2.0)]], dtype=torch.float64)
    loss, metrics = policy_loss(logp, logp.detach(), torch.ones(1, dtype=torch.float64), torch.ones(1, 1), ref_logp=ref)
    assert metrics["kl"] == pytest.approx(1.0 - math.log(2.0))
    assert loss.item() == pytest.approx(-1.0)


# --- decoupled objective (AReaL) -----------------------------------------------------------


def test_decoupled_weights_are_truncated_at_the_cap() -> None:
    # Ratio 1 (logp == proximal), A = 1, so each token's term is -w with
    # w = min(exp(proximal - behaviour), 1.5):
    #   behaviour -1 - ln 2 -> exp(ln 2)  = 2   -> 1.5 (truncated)
    #   behaviour -1 + ln 2 -> exp(-ln 2) = 0.5 -> 0.5
    #   behaviour -1        -> 1                -> 1
    #   behaviour -1 - ln 4 -> 4                -> 1.5 (truncated)
    # loss = -(1.5 + 0.5 + 1 + 1.5) / 4 = -1.125; d loss / d logp_t = -w_t / 4.
    logp = _leaf([[-1.0, -1.0, -1.0, -1.0]])
    ln2, ln4 = math.log(2.0), math.log(4.0)
    behaviour = torch.tensor([[-1.0 - ln2, -1.0 + ln2, -1.0, -1.0 - ln4]], dtype=torch.float64)
    adv = torch.tensor([1.0], dtype=torch.float64)
    loss, metrics = policy_loss(
        logp, logp.detach(), adv, torch.ones(1, 4), behaviour_logp=behaviour, objective="decoupled", tis_cap=1.5
    )
    assert loss.item() == pytest.approx(-1.125)
    assert metrics["is_weight_mean"] == pytest.approx(1.125)  # 4.5 / 4
    assert metrics["is_weight_deviation"] == pytest.approx(0.375)  # (0.5 + 0.5 + 0 + 0.5) / 4
    assert metrics["is_truncated_fraction"] == pytest.approx(0.5)  # 2 of 4 tokens above 1.5
    assert metrics["ratio_mean"] == pytest.approx(1.0)
    loss.backward()
    _assert_values(logp.grad, [[-0.375, -0.125, -0.25, -0.375]])


def test_decoupled_clips_the_ratio_to_the_proximal_policy_and_weights_by_proximal_over_behaviour() -> None:
    # Token 1: ratio exp(logp - proximal) = 1.5 > 1.2 with A = 1: clipped branch, term -1.2 * w,
    #          no gradient. Token 2: ratio 1.1, inside the band: term -1.1 * w, d/d logp = -1.1 * w.
    # Both tokens: w = exp(proximal - behaviour) = exp(ln 1.25) = 1.25 (below the cap 2).
    # loss = (-1.2 * 1.25 - 1.1 * 1.25) / 2 = (-1.5 - 1.375) / 2 = -1.4375
    # grad = [0, -1.375 / 2] = [0, -0.6875]; ratio_mean (1.5 + 1.1) / 2 = 1.3; clip_fraction 1/2.
    proximal = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    logp = _leaf([[-1.0 + math.log(1.5), -2.0 + math.log(1.1)]])
    behaviour = proximal - math.log(1.25)
    adv = torch.tensor([1.0], dtype=torch.float64)
    loss, metrics = policy_loss(
        logp, proximal, adv, torch.ones(1, 2), behaviour_logp=behaviour, objective="decoupled", clip_eps=0.2
    )
    assert loss.item() == pytest.approx(-1.4375)
    assert metrics["policy_loss"] == pytest.approx(-1.4375)
    assert metrics["ratio_mean"] == pytest.approx(1.3)
    assert metrics["clip_fraction"] == pytest.approx(0.5)
    assert metrics["is_weight_mean"] == pytest.approx(1.25)
    assert metrics["is_truncated_fraction"] == 0.0
    loss.backward()
    _assert_values(logp.grad, [[0.0, -0.6875]])


def test_grpo_ignores_the_behaviour_logprobs() -> None:
    # The same tokens as above with w = 1: loss = (-1.2 - 1.1) / 2 = -1.15, grad [0, -1.1 / 2].
    proximal = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    logp = _leaf([[-1.0 + math.log(1.5), -2.0 + math.log(1.1)]])
    behaviour = proximal - math.log(1.25)
    adv = torch.tensor([1.0], dtype=torch.float64)
    loss, metrics = policy_loss(logp, proximal, adv, torch.ones(1, 2), behaviour_logp=behaviour, objective="grpo")
    assert loss.item() == pytest.approx(-1.15)
    assert metrics["is_weight_mean"] == 1.0 and metrics["is_truncated_fraction"] == 0.0
    assert metrics["is_weight_deviation"] == 0.0
    loss.backward()
    _assert_values(logp.grad, [[0.0, -0.55]])


def test_decoupled_sequence_aggregation_and_padding() -> None:
    # Sequence 1: one valid token, w = exp(ln 2.5) = 2.5, capped at 3 -> 2.5; term -2.5 (A = 1).
    # Sequence 2: two valid tokens, w = 1 each; terms -1, -1. Padding holds nan / inf behaviour.
    # sequence aggregation: mean of per-sequence means = (-2.5 + -1) / 2 = -1.75
    # token aggregation:    (-2.5 - 1 - 1) / 3 = -1.5; is_weight_mean (2.5 + 1 + 1) / 3 = 1.5.
    mask = torch.tensor([[1, 0], [1, 1]])
    nan, inf = float("nan"), float("inf")
    behaviour = torch.tensor([[-1.0 - math.log(2.5), nan], [-1.0, -inf]], dtype=torch.float64)
    proximal = torch.tensor([[-1.0, inf], [-1.0, -inf]], dtype=torch.float64)
    behaviour[1, 1] = -1.0  # valid token: w = 1
    proximal[1, 1] = -1.0
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    results = {}
    for aggregation in ("sequence", "token"):
        logp = _leaf([[-1.0, 0.0], [-1.0, -1.0]])
        loss, metrics = policy_loss(
            logp,
            proximal,
            adv,
            mask,
            behaviour_logp=behaviour,
            objective="decoupled",
            tis_cap=3.0,
            aggregation=aggregation,
        )
        loss.backward()
        results[aggregation] = (loss.item(), metrics, logp.grad)
    assert results["sequence"][0] == pytest.approx(-1.75)
    assert results["token"][0] == pytest.approx(-1.5)
    assert results["token"][1]["is_weight_mean"] == pytest.approx(1.5)
    # sequence: d/d logp = -w / (2 sequences * tokens of the sequence)
    _assert_values(results["sequence"][2], [[-2.5 / 2, 0.0], [-1 / 4, -1 / 4]])
    _assert_values(results["token"][2], [[-2.5 / 3, 0.0], [-1 / 3, -1 / 3]])


def test_only_logp_receives_gradient() -> None:
    logp = _leaf([[-1.0, -2.0]])
    old = _leaf([[-1.1, -1.9]])
    ref = _leaf([[-1.0, -1.0]])
    adv = torch.tensor([1.0], dtype=torch.float64, requires_grad=True)
    loss, _ = policy_loss(logp, old, adv, torch.ones(1, 2), kl_coef=0.1, ref_logp=ref)
    loss.backward()
    assert logp.grad is not None
    assert old.grad is None and ref.grad is None and adv.grad is None


def test_policy_loss_rejects_inconsistent_inputs() -> None:
    logp = torch.zeros(2, 3)
    adv = torch.zeros(2)
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="proximal_logp"):
        policy_loss(logp, torch.zeros(2, 2), adv, mask)
    with pytest.raises(ValueError, match="behaviour_logp has shape"):
        policy_loss(logp, logp, adv, mask, behaviour_logp=torch.zeros(2, 2), objective="decoupled")
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp, logp, torch.zeros(3), mask)
    with pytest.raises(ValueError, match="aggregation"):
        policy_loss(logp, logp, adv, mask, aggregation="batch")
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, logp, adv, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="unknown objective 'auto'"):
        policy_loss(logp, logp, adv, mask, objective="auto")  # the caller resolves auto
    with pytest.raises(ValueError, match="needs behaviour_logp"):
        policy_loss(logp, logp, adv, mask, objective="decoupled")
    with pytest.raises(ValueError, match="tis_cap must be > 0"):
        policy_loss(logp, logp, adv, mask, behaviour_logp=logp, objective="decoupled", tis_cap=0.0)
    with pytest.raises(ValueError, match="clip_eps"):
        policy_loss(logp, logp, adv, mask, clip_eps=1.0)
    with pytest.raises(ValueError, match="kl_coef must be"):
        policy_loss(logp, logp, adv, mask, kl_coef=-1.0)
    with pytest.raises(ValueError, match="no token"):
        policy_loss(logp, logp, adv, torch.zeros(2, 3))
