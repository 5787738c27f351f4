"""V-trace (Espeholt et al., 2018): off-policy value targets for IMPALA's lagging actors.

With ``rho_t = min(rho_bar, pi(a_t|x_t) / mu(a_t|x_t))`` and ``c_t = min(c_bar, ...)``:
``v_s = V(x_s) + sum_t gamma^(t-s) (prod_{i<t} c_i) rho_t delta_t``, ``delta_t = r_t + gamma_t
V(x_{t+1}) - V(x_t)``, computed backwards as ``v_s - V(x_s) = rho_s delta_s + gamma_s c_s
(v_{s+1} - V(x_{s+1}))``. The policy gradient's advantage is ``rho_s (r_s + gamma_s v_{s+1} -
V(x_s))``.
"""

from __future__ import annotations

import torch

__all__ = ["vtrace"]


def vtrace(behaviour_logp: torch.Tensor, target_logp: torch.Tensor, rewards: torch.Tensor,
           values: torch.Tensor, discounts: torch.Tensor, rho_bar: float = 1.0,
           c_bar: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Value targets ``vs`` and policy-gradient advantages, both ``[B, T]`` (no gradient).

    ``values`` is ``[B, T + 1]`` (the last column bootstraps); the others are ``[B, T]``;
    ``discounts`` is ``gamma`` where an episode goes on and 0 where it ended.
    """
    with torch.no_grad():
        ratio = torch.exp(target_logp - behaviour_logp)
        rho = ratio.clamp(max=rho_bar)
        c = ratio.clamp(max=c_bar)
        deltas = rho * (rewards + discounts * values[:, 1:] - values[:, :-1])
        acc = torch.zeros_like(values[:, 0])
        out = []
        for t in range(rewards.shape[1] - 1, -1, -1):
            acc = deltas[:, t] + discounts[:, t] * c[:, t] * acc
            out.append(acc)
        vs_minus_v = torch.stack(out[::-1], 1)
        vs = vs_minus_v + values[:, :-1]
        next_vs = torch.cat([vs[:, 1:], values[:, -1:]], 1)
        advantages = rho * (rewards + discounts * next_vs - values[:, :-1])
    return vs, advantages
