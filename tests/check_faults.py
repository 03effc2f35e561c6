"""Faults injected into rollout.pipeline=async's generator process (tests/unit/check/test_check.py). The worker
runs in a fresh interpreter (spawn), where a monkeypatch of the test's process does not reach: the fault is a `build`
function the worker imports by name from this module (tests/ is on the sys.path the spawned process inherits)."""

import copy


def build_ignoring_syncs(cfg, state, device):
    """The worker's policy, tokenizer and rollout engine, except that the engine draws with a copy of the weights it
    started with: the weight syncs land in a model nothing generates with."""
    from rlrun.pipeline import worker

    policy, tokenizer, engine = worker.build(cfg, state, device)
    stale = copy.deepcopy(policy)

    class Stale:
        needs_sync = engine.needs_sync

        def sync(self, model):
            engine.sync(model)

        def generate(self, model, prompts, seeds):
            return engine.generate(stale, prompts, seeds)

    return policy, tokenizer, Stale()
