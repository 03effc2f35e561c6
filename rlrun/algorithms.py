"""The algorithms (the registry's `recipe` group, keyed by loss.name): what is true of each, said once here, for
the code outside its loop that must know it (the run's description, its learning curve, the planner, the
layouts). Light to import (no torch): the loop's module, in rlrun/recipes/, is imported when a run trains."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Algorithm:
    loop: str  # the module whose train(cfg, raw, tracker, resume) runs it (the step body, in one file)
    title: str  # the run description's first words; {loss}: the loss's name
    curve: str  # the learning curve: the metric the run's summary, the sweep and MLflow's views lead with
    pairs: bool  # trains on preference pairs (a chosen and a rejected completion of one prompt), not sampled groups
    samples: bool  # generates: its logprobs are of the sampler's distribution (rollout.temperature, top_p, top_k);
    # so a rollout to generate (and to record), an old policy that drew it, and a per-token objective over it
    reference: bool = False  # its loss always reads the reference policy's logprobs (DPO's implicit reward)
    probes: str | None = None  # the module of its own `rlrun check` probes (rows(cfg, baseline_config, exactness));
    # None: the probes of sampled rollouts (rlrun/check/__init__.py)
    loss_protocol: str = "rlrun.losses.protocol:TokenLoss"  # the contract of its losses (tests/unit/test_protocols.py)

    def train(self, cfg, raw, tracker, resume=None) -> dict[str, float]:
        return importlib.import_module(self.loop).train(cfg, raw, tracker, resume)

    def prompt_rows(self, cfg) -> int:
        """The sequences that share one prompt: a pair's 2, or a GRPO group's train.group_size."""
        return 2 if self.pairs else cfg.train.group_size


GRPO = Algorithm("rlrun.recipes.grpo", "GRPO-family RL ({loss} loss)", "reward_mean", pairs=False, samples=True)
DPO = Algorithm("rlrun.recipes.dpo", "DPO", "rewards/accuracy", pairs=True, samples=False, reference=True,
                probes="rlrun.check.dpo", loss_protocol="rlrun.losses.protocol:PairLoss")


def of(cfg) -> Algorithm:
    """The algorithm a config (or a loss name) trains with."""
    from . import registry

    return registry.get("recipe", cfg if isinstance(cfg, str) else cfg.loss.name)


def title(loss: str) -> str:
    """A run description's first words for `loss` (a name no algorithm has: said as it is)."""
    from . import registry

    return of(loss).title.format(loss=loss) if loss in registry.REGISTRY["recipe"] else f"RL ({loss} loss)"
