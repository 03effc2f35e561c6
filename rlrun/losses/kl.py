"""Per-token KL estimators of KL(policy || reference) from log-probabilities (Schulman, "Approximating KL").

With log r = ref - logprob: k1 = -log r, k2 = (log r)^2 / 2, k3 = (r - 1) - log r.
"""

import torch

ESTIMATORS = ("k1", "k2", "k3")


def kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    log_r = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r.square()
    if estimator == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(f"kl_estimator={estimator!r}; supported: {list(ESTIMATORS)}")
