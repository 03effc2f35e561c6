"""Recipes: one training loop per algorithm, each an explicit step body in one file.

`loss=dapo|cispo` run the GRPO recipe (grpo.py), `loss=dpo` the DPO recipe (dpo.py). What both share is in
rlrun/runner/: `setup` (every component, built once) and `Frame` (the step loop: cadence, signals, logging).
"""

from __future__ import annotations

import importlib

# loss name -> recipe module (the loss group stays the user's one switch)
RECIPES = {"dapo": "grpo", "cispo": "grpo", "dpo": "dpo"}


def recipe(loss: str):
    """The recipe module (with `train(cfg, raw, tracker, resume)`) that trains `loss`."""
    return importlib.import_module(f"{__name__}.{RECIPES[loss]}")
