"""Recipes: one training loop per algorithm, each an explicit step body in one file.

`loss=dapo|cispo` run the GRPO recipe (grpo.py), `loss=dpo` the DPO recipe (dpo.py): `registry.get("recipe",
loss)` gives the module, whose `train(cfg, raw, tracker, resume)` the runner calls. What both share (setup,
restore, progress, signals, metric reduction, logging, checkpoints) is the run frame in rlrun/runner.py.
"""
