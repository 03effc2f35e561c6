"""The window policy's decisions against a brute-force simulation of the step schedule."""

import itertools

import pytest

from rlrun.logprobs import Need, crosses_step, option, plan


def brute_force(rollout_batch, batch_size, micro_batch, num_iterations, n_rollouts):
    """Simulate micro-step by micro-step: version of the weights when each rollout is generated vs when each of
    its micro-steps trains. A rollout needs old logprobs iff some micro-step of it trains on other weights."""
    spg = rollout_batch // micro_batch
    grad_accum = batch_size // micro_batch
    weights_version_at = []  # weight version seen by each micro-step
    version = 0
    for micro_step in range(n_rollouts * spg * num_iterations):
        weights_version_at.append(version)
        if (micro_step + 1) % grad_accum == 0:
            version += 1  # optimizer step after this micro-step
    needs = []
    for r in range(n_rollouts):
        window = range(r * spg * num_iterations, (r + 1) * spg * num_iterations)
        generated_with = weights_version_at[window[0]]  # generated just before its first micro-step
        needs.append(any(weights_version_at[s] != generated_with for s in window))
    return needs


SIZES = itertools.product(range(1, 7), range(1, 7), [1, 2, 3])


@pytest.mark.parametrize("rollout_mult,batch_mult,num_iterations", SIZES)
@pytest.mark.parametrize("micro_batch", [1, 4])
def test_window_matches_brute_force(rollout_mult, batch_mult, num_iterations, micro_batch):
    rollout_batch, batch_size = rollout_mult * micro_batch, batch_mult * micro_batch
    spg, ga = rollout_batch // micro_batch, batch_size // micro_batch
    n = 24
    expected = brute_force(rollout_batch, batch_size, micro_batch, num_iterations, n)
    got = [plan("window", start=r * spg * num_iterations, window=spg * num_iterations, grad_accum=ga, ref_coef=0).old
           for r in range(n)]
    assert got == expected


def test_seed_example_two_of_six():
    # seed 001: steps per generation 2, num_iterations 1, gradient accumulation 3 -> 2 rollouts out of every 6
    decisions = [crosses_step(2 * r, 2, 3) for r in range(6)]
    assert sum(decisions) == 2 and decisions == [False, True, False, False, True, False]


def test_always_and_skip_and_reference_rule():
    assert plan("always", start=0, window=1, grad_accum=1, ref_coef=0) == Need(True, True)
    assert plan("skip", start=3, window=5, grad_accum=2, ref_coef=0) == Need(False, False)
    assert plan("window", start=0, window=1, grad_accum=1, ref_coef=0.1) == Need(False, True)
    assert not option("window").builds_reference(0.0) and option("window").builds_reference(0.1)
    assert option("always").builds_reference(0.0) and not option("skip").builds_reference(0.0)
    assert option("window").caches_reference and not option("always").caches_reference  # DPO's reference cache
    # the old pass of a sequence-level correction is needed before the loss: window runs it, skip is refused
    assert option("window").need(start=0, window=1, grad_accum=1, ref_coef=0, old_before_loss=True).old
    assert option("window").ever_needs_old(2, 2) is False and option("window").ever_needs_old(2, 2, True)
