"""A paired sweep's report (rlrun/tools/noise_floor.py): the exact options' largest difference from the recording
run is the noise floor, and an inexact option is stated as a multiple of it."""

import numpy as np

from rlrun.tools import noise_floor

REC = {"loss.name": "dapo", "train.precision": "fp32", "rollout.name": "hf", "rollout.record": "/s/record",
       "head.name": "dense"}


def replaying(**changes):
    p = {k: v for k, v in REC.items() if k != "rollout.record"}
    return {**p, "rollout.name": "replay", "rollout.path": "/s/record", **changes}


def curves(loss, grad):
    steps = np.arange(len(loss))
    return {"loss": (steps, np.array(loss, float)), "grad_norm": (steps, np.array(grad, float))}


def test_exact_runs_set_the_floor_and_inexact_ones_are_measured_against_it():
    params = [REC, replaying(**{"head.name": "tiled"}), replaying(**{"train.precision": "bf16"}),
              replaying(**{"loss.name": "cispo"})]
    names = ["dense", "tiled", "bf16", "cispo"]
    data = [curves([1.0, 2.0, 3.0], [5.0, 5.0, 5.0]), curves([1.0, 2.0 + 1e-8, 3.0], [5.0, 5.01, 5.02]),
            curves([1.001, 2.0, 3.003], [5.0, 5.5, 6.0]), curves([1.0, 2.0, 3.0], [5.0, 5.0, 5.01])]
    base, found = noise_floor.rows(names, data, params)
    assert base == "dense" and [r["exact"] for r in found] == [True, False, False]  # another objective: not exact
    assert noise_floor.floor(found) == {"loss": found[0]["loss"], "grad_norm": found[0]["grad_norm"]}
    assert abs(found[0]["grad_norm"] - 0.02) < 1e-9 and abs(found[1]["loss"] - 0.003) < 1e-9
    text = noise_floor.text((base, found))
    assert text.startswith("Paired against dense (the same rollouts, 3 steps): exact options' noise floor max |Δloss|")
    assert "bf16: max |Δloss| 3.0e-03 (" in text and "x the floor)" in text and "max |Δgrad_norm| 1.0e+00 (50x" in text
    assert "tiled:" not in text  # an exact run is the floor, not an entry
    assert noise_floor.figure_of(names, data, params) is not None
    assert noise_floor.brief((base, found)) == ("Paired on one record, each inexact option against the exact options' "
                                               "noise floor: bf16 3e+05x (loss); cispo 0.5x (grad_norm).")
    exact_only = [r for r in found if r["exact"]]
    assert noise_floor.brief((base, exact_only)).startswith("Paired on one record: the exact options' noise floor is "
                                                            "max |Δloss| 1.0e-08")


def test_runs_that_did_not_replay_one_record_are_not_paired():
    own = {**REC, "rollout.record": "None"}
    assert noise_floor.rows(["a", "b"], [curves([1], [1]), curves([1], [1])], [own, {**own, "head.name": "tiled"}]) \
        is None
    # a run that recorded, with nobody replaying it, is not a pairing either
    assert noise_floor.recording([REC, {**REC, "rollout.record": "/other"}]) is None
    assert noise_floor.figure_of(["a"], [curves([1], [1])], [REC]) is None
