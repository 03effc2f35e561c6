"""Run under torchrun (test_distributed.py): each head's loss and lm-head gradient under ZeRO-3 on this rank's
share of one global batch; rank 0 writes them to the JSON file given as argv[1]; argv[2]: tie embeddings."""

import json
import sys

import torch
from conftest import make_cfg
from deepspeed.utils import safe_get_full_grad
from helpers import HEADS

from rlrun import losses, models, registry
from rlrun.engine import deepspeed as ds_engine


def main(out: str, tied: str):
    cfg = make_cfg("experiment=smoke", "engine=deepspeed", "engine.zero_stage=3", "train.micro_batch=4",
                   f"model.tie_embeddings={tied}")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 50, (8, 10), generator=gen)  # the global batch; each rank takes 4 rows
    adv = torch.randn(8, generator=gen)
    results = {}
    for name in HEADS:
        policy, _ = models.build(cfg.model, 0)
        engine = ds_engine.Engine(cfg, policy, None, grad_accum=1)
        rows = slice(4 * engine.rank, 4 * engine.rank + 4)
        backbone, weight = models.split(engine.model)
        hidden = models.hidden_states(backbone, ids[rows], torch.ones_like(ids[rows]))[:, :-1].flatten(0, 1)
        targets = ids[rows, 1:].reshape(-1)
        mask = torch.ones_like(targets, dtype=torch.bool)
        a = adv[rows, None].expand(-1, 9).reshape(-1)
        old = torch.full_like(a, -4.0)  # off-policy: ratio != 1, some tokens clipped
        objective = losses.objective("dapo", a, old, None, old, clip_low=0.2, clip_high=0.28, kl_coef=0.0,
                                     kl_estimator="k3", tis_cap=None)
        head = registry.get("head", name)
        loss, _ = head.loss(hidden, weight, targets, mask, objective, int(mask.numel()) * engine.world, 1.0, 7)
        engine.ds.backward(loss * engine.world, scale_wrt_gas=False)
        grad = safe_get_full_grad(weight)  # collective: every rank gathers the reduced lm-head gradient
        total = sum(engine.gather(loss.item()))
        results[name] = {"loss": total, "grad": grad.flatten().tolist(), "gathered_numel": weight.ds_numel}
    if engine.rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    # leave the process group before exit: a rank that exits with gloo's threads still running can abort
    # ("terminate called without an active exception", SIGABRT) while the other is still in its last collective
    torch.distributed.barrier()
    ds_engine.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
