"""The GRPO objective as pure tensor functions: advantages, per-token log-probs, KL, entropy, loss.

`group_advantages`: group-normalised outcome rewards ``(r - mean_g) / (std_g + eps)`` (population
std), or ``r - mean_g`` with ``normalize_std=False`` (Dr. GRPO). `policy_loss`: PPO's clipped
surrogate on ``exp(logp - proximal_logp)``, the proximal policy being the trainer's weights at the RL
step's start (``clip_eps_high``: DAPO's clip-higher); at one update per step the ratio is 1 and the
clip never acts. ``objective="decoupled"`` (AReaL, for stale samples) weights each token by the
constant ``min(exp(proximal_logp - behaviour_logp), tis_cap)``, truncating at the cap where AReaL
drops the token; ``"grpo"`` weights 1. `kl_k3` is added to the loss, not the reward. Aggregation:
``token`` (DAPO: valid tokens' sum / count) or ``sequence`` (GRPO: mean of per-sequence means).

Simplifies, on purpose: no value model or GAE (the group baseline is the critic); outcome rewards
only; no entropy bonus (`entropy_from_logits` monitors) and no length penalty; no dual clip; a
per-token importance weight; the proximal policy is exact, never approximated from behaviour
log-probs. Detail: docs/algorithm.md, docs/staleness.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

AGGREGATIONS = ("token", "sequence")
OBJECTIVES = ("grpo", "decoupled")
"""What `policy_loss` computes (`GRPOConfig.objective`'s `auto` is resolved by the caller)."""


def objective_of(configured: str) -> str:
    """What `policy_loss` computes for `GRPOConfig.objective` `configured`: `auto`, left unresolved,
    counts as `grpo` (the training session resolves it by `training.max_staleness`)."""
    return "decoupled" if configured == "decoupled" else "grpo"


def group_advantages(
    rewards: Tensor,
    group_size: int | None = None,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """Group-relative advantages of outcome rewards.

    ``rewards`` is ``[num_groups, group_size]``, or flat ``[num_groups * group_size]`` with
    ``group_size`` given (groups are consecutive runs). The result has the input's shape:
    ``(r - mean_g) / (std_g + eps)`` with the population std (``unbiased=False``) when
    ``normalize_std``, else ``r - mean_g``. A group whose rewards are all equal carries no
    signal and gets exactly zero advantage.
    """
    if rewards.dim() == 1:
        if group_size is None:
            raise ValueError("flat rewards need group_size; or pass [num_groups, group_size]")
        if group_size <= 0 or rewards.numel() % group_size:
            raise ValueError(f"{rewards.numel()} rewards cannot be split into groups of {group_size}")
        grouped = rewards.reshape(-1, group_size)
    elif rewards.dim() == 2:
        if group_size is not None and group_size != rewards.shape[1]:
            raise ValueError(f"group_size={group_size} contradicts rewards of shape {tuple(rewards.shape)}")
        grouped = rewards
    else:
        raise ValueError(f"rewards must be [num_groups, group_size] or flat; got shape {tuple(rewards.shape)}")
    grouped = grouped.float()
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std:
        centred = centred / (grouped.std(dim=1, unbiased=False, keepdim=True) + eps)
    constant = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)
    advantages = torch.where(constant, torch.zeros_like(centred), centred)
    return advantages.reshape(rewards.shape)


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(policy || reference): ``exp(d) - d - 1`` with ``d = ref - logp``.

    Unbiased for the KL when tokens are sampled from the policy, and never negative.
    """
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1.0


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the softmax distribution at each position: ``[..., vocab] -> [...]``."""
    logits = logits.float()
    log_probs = torch.log_softmax(logits, dim=-1)
    return -(log_probs.exp() * log_probs).sum(dim=-1)


def token_logprobs(logits: Tensor, target_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probability of each target under ``softmax(logits / temperature)``.

    ``logits`` is ``[..., vocab]`` already aligned with ``target_ids`` ``[...]`` (the caller
    shifts by one for next-token prediction). Computed in float32. Use the sampling temperature
    so the log-probs match the ones recorded at rollout.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != target_ids.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and target_ids {tuple(target_ids.shape)} disagree on the leading dimensions"
        )
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return log_probs.gather(-1, target_ids.long().unsqueeze(-1)).squeeze(-1)


def _aggregate(values: Tensor, mask: Tensor, aggregation: str) -> Tensor:
    """Masked mean of ``[B, T]`` values: over all valid tokens, or of per-sequence means."""
    if aggregation == "token":
        return (values * mask).sum() / mask.sum()
    lengths = mask.sum(dim=1)
    present = lengths > 0
    per_sequence = (values * mask).sum(dim=1)[present] / lengths[present]
    return per_sequence.mean()


def policy_loss(
    logp: Tensor,
    proximal_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    behaviour_logp: Tensor | None = None,
    objective: str = "grpo",
    tis_cap: float = 2.0,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    kl_coef: float = 0.0,
    ref_logp: Tensor | None = None,
    aggregation: str = "token",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped GRPO loss over response tokens (``grpo`` or AReaL's ``decoupled``), and its metrics.

    ``logp`` (current policy, carries the gradient), ``proximal_logp`` (the trainer's policy at the
    RL step's start), ``behaviour_logp`` (the engine's, at sampling), ``ref_logp`` and ``mask`` (1
    for valid response tokens) are ``[B, T]``; ``advantages`` is ``[B]`` and applies to every token
    of its sequence. Per token, with ``ratio = exp(logp - proximal_logp)``::

        loss = -min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps_high) * A) * w
               + kl_coef * k3(logp, ref_logp)

    where ``w = min(exp(proximal_logp - behaviour_logp), tis_cap)`` for ``objective="decoupled"``
    (``behaviour_logp`` required) and ``w = 1`` for ``"grpo"`` (``behaviour_logp`` is then not
    used); then aggregated by ``aggregation`` (``"token"`` or ``"sequence"``, see the module
    docstring). Only ``logp`` is differentiated; every other input is detached. Sequences with no
    valid token are ignored by ``"sequence"``.

    Metrics (detached 0-dim tensors on ``logp``'s device, over valid tokens): ``loss``,
    ``policy_loss`` (without the KL term), ``kl`` (mean k3; 0 without ``ref_logp``),
    ``clip_fraction`` (tokens where the clipped branch is taken), ``ratio_mean``,
    ``is_weight_mean`` (mean ``w``; 1 for ``grpo``), ``is_weight_deviation`` (mean ``|w - 1|``, how
    far the weights spread from on-policy; 0 for ``grpo``) and ``is_truncated_fraction`` (tokens
    whose untruncated weight exceeds ``tis_cap``; 0 for ``grpo``). They stay tensors so that computing
    them never waits for the device; the caller reads them once per optimizer step. The one value
    read here is the check that ``mask`` selects a token (the trainer builds its masks on the host).
    """
    if logp.dim() != 2:
        raise ValueError(f"logp must be [batch, tokens], got shape {tuple(logp.shape)}")
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; expected one of {OBJECTIVES}")
    for name, tensor in (
        ("proximal_logp", proximal_logp),
        ("mask", mask),
        ("ref_logp", ref_logp),
        ("behaviour_logp", behaviour_logp),
    ):
        if tensor is not None and tensor.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(logp.shape)} like logp")
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"advantages must be [batch]={logp.shape[0]}, got shape {tuple(advantages.shape)}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; expected one of {AGGREGATIONS}")
    clip_high = clip_eps if clip_eps_high is None else clip_eps_high
    if not 0 < clip_eps < 1 or clip_high <= 0:
        raise ValueError(f"need 0 < clip_eps < 1 and clip_eps_high > 0; got {clip_eps}, {clip_eps_high}")
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if kl_coef > 0 and ref_logp is None:
        raise ValueError("kl_coef > 0 needs ref_logp (log-probs of the reference policy)")
    if objective == "decoupled":
        if behaviour_logp is None:
            raise ValueError(
                "objective 'decoupled' needs behaviour_logp (the engine's log-probs of the sampled tokens)"
            )
        if not tis_cap > 0:
            raise ValueError(f"tis_cap must be > 0, got {tis_cap}")

    valid = mask.detach().bool()
    if not valid.any():
        raise ValueError("mask selects no token; nothing to train on")
    weights = valid.to(logp.dtype)

    def on_valid(tensor: Tensor) -> Tensor:
        # Padding may hold anything (even inf); zero it before any arithmetic so that neither
        # the loss nor the gradient can see it.
        return torch.where(valid, tensor, torch.zeros_like(tensor))

    logp = on_valid(logp)
    proximal = on_valid(proximal_logp.detach())
    adv = advantages.detach().to(logp.dtype).unsqueeze(1)

    ratio = torch.exp(logp - proximal)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_high) * adv
    per_token_pg = -torch.minimum(unclipped, clipped)
    if objective == "decoupled":
        assert behaviour_logp is not None, "checked above: decoupled needs behaviour_logp"
        untruncated = torch.exp(proximal - on_valid(behaviour_logp.detach().to(logp.dtype)))
        is_weight = untruncated.clamp(max=tis_cap)
        truncated = untruncated > tis_cap
        per_token_pg = per_token_pg * is_weight
    else:
        is_weight = torch.ones_like(proximal)
        truncated = torch.zeros_like(valid)

    pg_loss = _aggregate(per_token_pg, weights, aggregation)
    loss = pg_loss
    kl_mean = torch.zeros((), dtype=logp.dtype, device=logp.device)
    if ref_logp is not None:
        per_token_kl = kl_k3(logp, on_valid(ref_logp.detach()))
        kl_mean = _aggregate(per_token_kl.detach(), weights, "token")
        if kl_coef > 0:
            loss = pg_loss + kl_coef * _aggregate(per_token_kl, weights, aggregation)

    with torch.no_grad():
        was_clipped = ((adv > 0) & (ratio > 1.0 + clip_high)) | ((adv < 0) & (ratio < 1.0 - clip_eps))
        metrics = {
            "loss": loss.detach(),
            "policy_loss": pg_loss.detach(),
            "kl": kl_mean,
            "clip_fraction": _aggregate(was_clipped.to(weights.dtype), weights, "token"),
            "ratio_mean": _aggregate(ratio, weights, "token"),
            "is_weight_mean": _aggregate(is_weight, weights, "token"),
            "is_weight_deviation": _aggregate((is_weight - 1).abs(), weights, "token"),
            "is_truncated_fraction": _aggregate(truncated.to(weights.dtype), weights, "token"),
        }
    return loss, metrics
