"""Recipes: one training loop per algorithm, each an explicit step body in one file.

`loss=dapo|cispo|gspo` run the GRPO recipe (grpo.py), `loss=dpo` the DPO recipe (dpo.py): `registry.get("recipe",
loss)` gives the algorithm (rlrun/algorithms.py: what is true of it, and `train(cfg, raw, tracker, resume)`, which the
runner calls and which runs the module's loop). What both share is in
rlrun/runner/: `setup` (every component, built once) and `Frame` (the step loop: cadence, signals, logging).
"""
