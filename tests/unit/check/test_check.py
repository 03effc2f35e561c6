"""`rlrun check` (rlrun/check/): the user's combination proven on a probe rollout. The default and the issue's
combination pass every probe; each failure class the field has met silently, injected, makes its own probe fail
(and the check exit 1)."""

import subprocess
import sys

import pytest
import torch
from conftest import make_cfg
from helpers import pairs_bound

from rlrun import check, pairs, policy, precision
from rlrun.config import validate

ALL_PROBES = {"on-policy ratio", "generator = trainer", "sampler filter", "accumulation", "ranks", "sequence alone",
              "policy copies", "no full logits", "memory plan", "vs baseline", "objective vs truth", "data decisions",
              "decode branches", "speculation", "master weights", "logprob schedule", "generator process", "resume"}
COMBINATION = ["loss=cispo", "head=tiled", "batching=shared_prompt", "activations=checkpoint", "train.precision=bf16",
               "rollout.pipeline=async"]


def verdicts(*overrides) -> dict:
    """probe -> True / False / None (does not apply) of `rlrun check` on the smoke config with `overrides`."""
    cfg = validate(make_cfg("experiment=smoke", *overrides))
    with torch.random.fork_rng():
        ctx = check.build(cfg)
        return {r.probe: r.ok for r in check.run_probes(ctx)}


@pytest.mark.slow  # builds the configuration and its baseline, draws a rollout (~10 s each)
@pytest.mark.parametrize("overrides", [[], COMBINATION, ["head=chunked", "rollout.top_p=0.8", "batching=packed",
                                                         "model.lora.enabled=true"],
                                       ["head=tiled", "rollout.top_k=5", "rollout.top_p=0.9",
                                        "train.num_iterations=2"]],
                         ids=["default", "issue-combination", "top_p-lora-packed", "top_k-tiled-two-passes"])
def test_every_probe_passes_on_configurations_that_are_right(overrides):
    got = verdicts(*overrides)
    assert set(got) == ALL_PROBES
    assert all(ok is not False for ok in got.values()), got


@pytest.mark.slow  # a subprocess: the command, its table and its exit code
def test_the_command_prints_one_table_and_exits_0(tmp_path):
    r = subprocess.run([sys.executable, "-m", "rlrun", "check", "experiment=smoke", "head=tiled"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    # sync, 1 pass, one head: 3 n/a; the counts add up to the progress lines' (one count of the table's rows)
    assert lines[0].split()[:2] == ["probe", "measured"] and lines[-1] == "15 of 15 probes pass (3 n/a)"
    assert "rlrun check: probe 18 of 18: resume" in r.stderr and "probes 11-12 of 18" in r.stderr, r.stderr[-2000:]
    assert all(len(line) <= 100 for line in lines), max(lines, key=len)  # a 100-column console
    assert not list(tmp_path.iterdir())  # a check writes nothing


def test_a_failed_probe_says_what_it_expects_its_failure_class_and_what_to_try_next():
    from rlrun import check
    from rlrun.check.probes import Row

    rows = [Row("accumulation", "2 micro-batches = 1: gradients within 1e-05", "max rel diff 3.7e-02", False,
                "modelscope/ms-swift#10117 (gradient accumulation normalised per micro-batch)"),
            Row("ranks", "2 ranks = 1", "max rel diff 0.0e+00", True, "prime-rl#2358"),
            Row("logprob schedule", "n/a: no rollout spans an optimizer step", "-", None, "")]
    text = check.lines(rows).splitlines()
    assert all(len(line) <= 100 for line in text)
    assert text[1].startswith("FAIL  accumulation      max rel diff 3.7e-02")
    rest = " ".join(line.strip() for line in text[2:-2])
    assert "expects: 2 micro-batches = 1: gradients within 1e-05" in rest and "failure class: modelscope" in rest
    assert "try: train.micro_batch=<train.batch_size> (one micro-batch)" in rest
    assert text[-2].startswith("pass  ranks") and "try" not in text[-2]
    assert text[-1].startswith("-     logprob schedule  n/a: no rollout spans")
    assert set(check.TRY) == {n for _, names in check.PROBES for n in names}  # every probe has its hint


# -- each failure class, injected, fails its probe -------------------------------------------------------------------

def generator_off_by_a_step(monkeypatch):
    """The generator's weights not synced: a copy that missed an update (trl#5312's class)."""
    build = policy.build

    def stale(cfg, role, **kw):
        model = build(cfg, role, **kw)
        if role == "generator":
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-2 * torch.randn_like(p))
        return model

    monkeypatch.setattr(policy, "build", stale)


def padding_attended(monkeypatch):
    """Left padding leaks into a sequence: its pad positions attended to (the class of unsloth-zoo#840, where
    padding moved what a sequence computes; a uniform shift of RoPE positions alone cancels out, a mask does not)."""
    from rlrun import models

    def leaky(backbone, input_ids, attention_mask):
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        return backbone(input_ids=input_ids, attention_mask=torch.ones_like(attention_mask), position_ids=positions,
                        use_cache=False).last_hidden_state

    monkeypatch.setattr(models, "hidden_states", leaky)


def normalised_twice(monkeypatch):
    """Each micro-batch's loss divided by the number of micro-batches again (ms-swift#10117)."""
    from rlrun.losses.bound import Objective

    prepare = Objective.prepare

    def twice(self, micros, gather):
        out, divisor, tokens = prepare(self, micros, gather)
        return out, divisor * len(out), tokens

    monkeypatch.setattr(Objective, "prepare", twice)


def normalised_per_rank(monkeypatch):
    """Each rank's loss divided by its own token count, not the step's over the ranks (prime-rl#2358,
    torchtitan#1842): the same as the right one on one rank, so only the ranks probe can see it."""
    from rlrun.losses.bound import Objective

    prepare = Objective.prepare
    monkeypatch.setattr(Objective, "prepare", lambda self, micros, gather: prepare(self, micros, lambda obj: [obj]))


def full_distribution(monkeypatch):
    """The trainer's logprobs over the whole vocabulary while the sampler's are top-p renormalised (trl#6789)."""
    from rlrun.heads import common, dense

    monkeypatch.setattr(common, "top_p_", lambda z, targets, top_p, top_k=0: z)
    monkeypatch.setattr(dense, "top_p_drop", lambda z, targets, top_p, top_k=0: torch.zeros_like(z, dtype=torch.bool))


def outside_bf16(copy: str):
    """One copy of the policy (`copy`: its role) built without the trainer's precision (rlrun #36)."""
    def inject(monkeypatch):
        apply = precision.apply
        monkeypatch.setattr(precision, "apply", lambda model, cfg, role="trainer": None if role == copy else
                            apply(model, cfg, role))
    return inject


generator_in_fp32 = outside_bf16("generator")


def tiled_builds_the_logits(monkeypatch):
    """A tiled head that computes the dense logits after all (NeMo-RL#2871, slime#2253)."""
    from rlrun.heads import dense, tiled

    monkeypatch.setattr(tiled, "loss", dense.loss)


def bf16_without_master_weights(monkeypatch):
    """train.precision=bf16 as bf16 weights, no fp32 master copy: every update below a bf16 step of a weight is lost
    (issue #53: `vs baseline` measured 1.7e-2, inside bf16's 5e-2)."""
    monkeypatch.setattr(precision.Bf16, "apply", lambda self, model, role: model.to(torch.bfloat16))


def window_never_recomputes(monkeypatch):
    """logprob_policy=window that never runs the old-policy pass, even for a rollout that spans optimizer steps: the
    ratio is taken against the current weights (exactly 1), PPO clipping silently off (issue #53)."""
    from rlrun import logprobs

    monkeypatch.setattr(logprobs.Window, "need", lambda self, *, start, window, grad_accum, ref_coef,
                        old_before_loss=False: logprobs.Need(old=old_before_loss, ref=ref_coef != 0))


def generator_process_ignores_syncs(monkeypatch):
    """rollout.pipeline=async's worker process drawing with the weights it started with, whatever is synced (issue
    #53: check built the generator in-process, so the process a run uses was never probed)."""
    import check_faults

    from rlrun.pipeline import worker

    monkeypatch.setattr(worker, "build", check_faults.build_ignoring_syncs)


INJECTED = [(generator_off_by_a_step, ["rollout.pipeline=async"], "generator = trainer"),
            (padding_attended, ["task.max_terms=4"], "sequence alone"),  # prompts of several lengths
            (normalised_twice, [], "accumulation"),
            (normalised_per_rank, ["loss.agg=seq_mean_token_mean"], "ranks"),
            (full_distribution, ["rollout.top_p=0.8", "logprob_policy=always"], "sampler filter"),
            (full_distribution, ["rollout.top_k=5", "logprob_policy=always"], "sampler filter"),  # top_k too
            (generator_in_fp32, ["train.precision=bf16", "rollout.pipeline=async"], "policy copies"),
            (tiled_builds_the_logits, ["head=tiled"], "no full logits"),
            (bf16_without_master_weights, ["train.precision=bf16"], "master weights"),
            (window_never_recomputes, ["train.num_iterations=2"], "logprob schedule"),  # a rollout spans 2 steps
            (generator_process_ignores_syncs, ["rollout.pipeline=async"], "generator process")]


@pytest.mark.slow  # a check per class (~10 s each)
@pytest.mark.parametrize("inject,overrides,probe", INJECTED, ids=[f"{p} ({' '.join(o)})" for _, o, p in INJECTED])
def test_each_injected_failure_fails_its_probe(monkeypatch, inject, overrides, probe):
    inject(monkeypatch)
    rows = rows_of(*overrides)
    got = {name: r.ok for name, r in rows.items()}
    assert got[probe] is False, got
    # by what it measured: an injection that breaks the probe's own code (a TypeError) would fail it too
    assert not rows[probe].measured.startswith("raised "), rows[probe]
    if inject is normalised_per_rank:  # one rank normalises right: no other probe can see it (the memory plan's
        # forecast is left out: it reads process RSS, which an earlier test's allocations can move)
        assert [p for p, ok in got.items() if ok is False and p != "memory plan"] == ["ranks"], got


def test_live_tensors_counts_the_peak_of_what_is_alive_once_per_storage_and_not_the_weights():
    from rlrun.check.watch import LiveTensors

    weight = torch.zeros(1024, 256)  # 1 MiB
    with LiveTensors(ignore=[weight]) as live:
        kept = torch.ones(1024, 256)  # 1 MiB, alive at the end
        view = weight.t()  # a view of an ignored storage: nothing new
        gone = torch.ones(2048, 256) + kept.sum()  # 2 MiB, freed below
        also = gone[:10]  # a view: the same storage, counted once
        del gone, also, view
        tail = torch.ones(512, 256)  # 0.5 MiB, after the 2 MiB was freed
    # the peak: kept, the 2 MiB of ones and the sum made from them (and the 4 bytes of kept.sum()) at once
    assert (live.peak, live.live) == (5 * 2**20 + 4, int(1.5 * 2**20))
    del kept, tail


@pytest.mark.slow  # two checks' memory probes
def test_on_cpu_the_memory_plan_probe_judges_the_plans_tensors_and_a_missing_term_fails(monkeypatch):
    """SmolLM2's probes measured RSS 264-315 MiB over a plan of 135 that the step's live tensors (141) met: glibc's
    kept heap blocks, not a term of the plan. On CPU the probe judges the plan's tensors against the live tensors
    (RSS shown beside); a plan that leaves out the saved activations still fails."""
    wide = ("model.hidden_size=512", "model.intermediate_size=2048", "model.heads=8", "model.kv_heads=8",
            "model.vocab_size=4096", "rollout.max_new_tokens=48")  # a step of ~170 MiB (the floor is 32)
    ctx = check.build(validate(make_cfg("experiment=smoke", "batching=packed", *wide)))
    row = check.plan_probe(ctx)
    assert row.ok is True and "live tensors" in row.measured and "RSS" in row.measured, row
    keep = check.plan.predict

    def without_activations(cfg, *a, **k):
        p = keep(cfg, *a, **k)
        p.phases["train"].parts = {n: v for n, v in p.phases["train"].parts.items()
                                   if not n.startswith("activations saved")}
        return p

    monkeypatch.setattr(check.plan, "predict", without_activations)
    row = check.plan_probe(ctx)
    assert row.ok is False and "live tensors" in row.measured, row


@pytest.mark.slow  # the memory probe twice at vocabulary 32000 (~20 s each)
@pytest.mark.parametrize("tie", [True, False])
def test_a_full_fine_tune_is_planned_at_the_end_of_backward_and_measured_without_the_probes_copies(tie, monkeypatch):
    """A full fine-tune at vocabulary 32000, hidden 512, whose micro-batches accumulate. Tied (the lm head is the
    input embedding): the lm head's gradient waits in autograd's buffer for the embedding's, and the two are summed
    into a third, three [vocab, hidden] tensors beside the gradients once the activations are gone
    (terms.end_of_backward): planned 286.2 MiB against 286.3 of live tensors; without the term 185.1, a failure.
    Untied: planned 247.6; the probe measured 322.4 while the copy of every gradient it keeps for the other probes
    was counted as the step's (probes.train_step copy_grads=False: 247.9), a false failure."""
    from rlrun.plan import terms

    shape = (f"model.tie_embeddings={str(tie).lower()}", "model.vocab_size=32000", "model.hidden_size=512",
             "model.intermediate_size=1376", "model.heads=8", "model.kv_heads=8")
    ctx = check.build(validate(make_cfg(*shape)))
    row = check.plan_probe(ctx)
    assert row.ok is True and "live tensors" in row.measured, row
    if tie:
        monkeypatch.setattr(terms, "end_of_backward", lambda s, forwards: 0)
    else:  # the probe's own copies of the gradients counted again
        step = check.probes.train_step
        monkeypatch.setattr(check.probes, "train_step", lambda *a, **k: step(*a, **{**k, "copy_grads": True}))
    row = check.plan_probe(ctx)
    assert row.ok is False and "live tensors" in row.measured, row


@pytest.mark.slow  # builds the configuration and draws a probe rollout
def test_the_memory_plan_probe_measures_a_step_that_accumulates_as_the_run_does(monkeypatch):
    """Where the configuration's micro-batches accumulate, the probe's measured step does too (its peak, as a run's,
    holds the gradients of the micro-batch before) and is planned so; the median of PLAN_STEPS steps."""
    cfg = validate(make_cfg("experiment=smoke", "train.micro_batch=8", "train.batch_size=16",
                            "train.rollout_batch=16"))
    ctx = check.build(cfg)
    seen, predict = [], check.plan.predict
    monkeypatch.setattr(check.probes, "train_step", lambda model, micros, *a, **k: seen.append(len(micros)))
    monkeypatch.setattr(check.plan, "predict", lambda c, *a, **k: seen.append(check.plan.grad_accum(c, 1))
                        or predict(c, *a, **k))
    check.plan_probe(ctx)
    assert seen == [2 * len(ctx.micros), *[2 * len(ctx.micros)] * check.PLAN_STEPS]


# -- loss=dpo: the probes that apply to preference pairs (rlrun/check/dpo.py) ---------------------------------------

DPO_PROBES = ALL_PROBES


def dpo_verdicts(*overrides) -> dict:
    return {r.probe: r.ok for r in check.rows_of(validate(make_cfg("experiment=smoke", "loss=dpo", *overrides)))}


@pytest.mark.parametrize("overrides", [[], ["head=chunked", "batching=shared_prompt", "activations=checkpoint",
                                            "train.precision=bf16"], ["model.lora.enabled=true", "batching=packed"]],
                         ids=["default", "chunked-shared-checkpoint-bf16", "lora-packed"])
def test_dpo_probes_pass_on_configurations_that_are_right(overrides):
    got = dpo_verdicts(*overrides)
    assert set(got) == DPO_PROBES
    assert got["on-policy ratio"] is got["generator = trainer"] is got["sampler filter"] is None  # nothing drawn
    assert all(got[p] is True for p in ("accumulation", "sequence alone", "policy copies")), got
    assert all(ok is not False for ok in got.values()), got


def dpo_normalised_per_micro_batch(monkeypatch):
    """Each micro-batch's DPO loss its own mean (num_pairs: its pairs, not the batch's), summed (ms-swift#10117)."""
    from rlrun.losses import dpo as dpo_losses

    loss = dpo_losses.dpo_loss
    monkeypatch.setattr(dpo_losses, "dpo_loss", lambda chosen, *a, **k: loss(chosen, *a, **{**k, "num_pairs": None}))


def chunked_builds_the_logits(monkeypatch):
    from rlrun.heads import chunked, dense

    monkeypatch.setattr(chunked, "logprobs", dense.logprobs)


DPO_INJECTED = [(dpo_normalised_per_micro_batch, [], "accumulation"),
                (outside_bf16("reference"), ["train.precision=bf16"], "policy copies"),
                (chunked_builds_the_logits, ["head=chunked"], "no full logits"),
                (bf16_without_master_weights, ["train.precision=bf16"], "master weights")]


@pytest.mark.parametrize("inject,overrides,probe", DPO_INJECTED, ids=[p for _, _, p in DPO_INJECTED])
def test_each_injected_failure_fails_its_dpo_probe(monkeypatch, inject, overrides, probe):
    inject(monkeypatch)
    got = dpo_verdicts(*overrides)
    assert got[probe] is False, got


# -- the exact axes' options, every pair of them checked (an all-pairs covering array) -----------------------------

AXES = pairs.exact_axes()  # from the registry: head, logprob_policy, offload, batching, activations, precision


def test_the_covering_array_covers_every_pair():
    assert set(AXES) == {"head", "logprob_policy", "offload", "batching", "activations", "train.precision"}
    rows = pairs.all_pairs(AXES)
    keys = list(AXES)
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            assert {(r[a], r[b]) for r in rows} == {(x, y) for x in AXES[a] for y in AXES[b]}, (a, b)
    assert len(rows) <= pairs_bound(map(len, AXES.values()))  # a covering array, not the product of the counts


@pytest.mark.slow  # ~10 checks of ~10 s
def test_every_probe_passes_on_an_all_pairs_covering_array_of_the_exact_axes():
    failed = {}
    for row in pairs.all_pairs(AXES):
        got = verdicts(*(f"{k}={v}" for k, v in row.items()))
        bad = [p for p, ok in got.items() if ok is False]
        if bad:
            failed[" ".join(f"{k}={v}" for k, v in row.items())] = bad
    assert not failed, failed


# -- every sweep job runs its check first (report.check_jobs) -------------------------------------------------------

def test_a_sweep_job_whose_check_fails_is_failed_naming_the_probe_and_trains_nothing(tmp_path, monkeypatch):
    from helpers import runs

    from rlrun import cli
    from rlrun.check.probes import Row

    monkeypatch.setattr(check, "rows_of", lambda cfg, job=False: [Row("sequence alone", "-", "-", False, "-"),
                                                       Row("accumulation", "-", "-", True, "-")])
    out = cli.sweep_job(make_cfg("experiment=smoke", tmp_path=tmp_path), "job-a")
    assert out["error"].startswith("CheckError: rlrun check: 1 of 2 probes pass; FAILED: sequence alone")
    _, [r] = runs(tmp_path / "mlflow.db")
    assert r.info.status == "FAILED" and "FAILED: sequence alone" in r.data.tags["error"]
    assert not any(k.startswith("train/") for k in r.data.metrics)  # refused before its first step


@pytest.mark.slow  # trains two steps
def test_a_sweep_job_whose_memory_plan_misses_trains_with_the_miss_logged(tmp_path, monkeypatch):
    """The plan is a forecast, not what is trained: its miss does not stop the job (every job of the activations
    sweep was failed on CPU RSS at 15-20% off), it is in the job's check metrics and tag."""
    from helpers import runs

    from rlrun import cli
    from rlrun.check.probes import Row

    monkeypatch.setattr(check, "rows_of", lambda cfg, job=False: [
        Row("memory plan", "-", "-", False, "-", blocks=False), Row("accumulation", "-", "-", True, "-")])
    out = cli.sweep_job(make_cfg("experiment=smoke", "train.steps=2", tmp_path=tmp_path), "job-a")
    assert "error" not in out, out
    _, [r] = runs(tmp_path / "mlflow.db")
    assert r.info.status == "FINISHED" and r.data.metrics["system/check/memory_plan"] == 0.0
    assert r.data.tags["rlrun.check"] == "1 of 2 probes pass; FAILED: memory plan"


def test_check_metrics_name_each_probe_that_applies():
    from rlrun.check.probes import Row

    rows = [Row("generator = trainer", "-", "-", True, "-"), Row("no full logits", "-", "-", None, "-"),
            Row("vs baseline", "-", "-", False, "-")]
    assert check.metrics(rows) == {"check/generator_trainer": 1.0, "check/vs_baseline": 0.0}
    assert check.summary(rows) == "1 of 2 probes pass (1 n/a); FAILED: vs baseline"


def rows_of(*overrides) -> dict:
    cfg = validate(make_cfg("experiment=smoke", *overrides))
    with torch.random.fork_rng():
        return {r.probe: r for r in check.run_probes(check.build(cfg))}


@pytest.mark.slow  # two checks (~10 s each)
def test_past_the_fp_tolerance_an_exact_option_is_judged_against_float64_and_a_real_error_still_fails(monkeypatch):
    """A real model's rounding can pass 1e-5 (SmolLM2, chunked: 1.6e-5); then the option must be no further from
    the float64 step than the baseline's fp32 is. Forced here with a tolerance of 0 on the tiny model."""
    from rlrun.check import probes

    monkeypatch.setattr(probes, "FP_TOL", 0.0)
    row = rows_of("head=chunked", "batching=packed")["vs baseline"]
    assert row.ok is True and "vs fp64" in row.measured, row
    base_err = float(row.measured.rsplit("baseline's ", 1)[1].split()[0])
    assert 0 < base_err < 1e-5, row.measured  # fp32 rounds; the arbiter is float64 (the dense head included)

    step = probes.train_step

    def off(model, micros, ax, *a, **k):  # the option's path (the chunked head) 1e-4 off: far below any
        loss, parts, grads = step(model, micros, ax, *a, **k)  # normaliser bug, far above rounding
        if ax.head.impl.TILED:
            loss, grads = loss * (1 + 1e-4), {n: g * (1 + 1e-4) for n, g in grads.items()}
        return loss, parts, grads

    monkeypatch.setattr(probes, "train_step", off)
    row = rows_of("head=chunked", "batching=packed")["vs baseline"]
    assert row.ok is False and "vs fp64" in row.measured, row


@pytest.mark.slow  # two checks (~10 s each)
def test_past_the_tolerance_sequence_alone_is_decided_in_float64_and_a_leaking_pad_still_fails(monkeypatch):
    """SmolLM2 on one thread rounds a batched logprob 2.1e-5 off the same alone; the float64 comparison decides.
    Forced here with a tolerance of 0 on the tiny model: right layouts pass, attended padding fails."""
    from rlrun.check import probes

    monkeypatch.setattr(probes, "RATIO_TOL", -1.0)  # the tiny model's packs are often bit-equal: force the path
    row = rows_of("batching=packed", "head=tiled")["sequence alone"]
    assert row.ok is True and "float64" in row.measured, row
    assert float(row.measured.rsplit("float64 ", 1)[1]) < 1e-12, row.measured  # rounding vanishes in float64
    padding_attended(monkeypatch)
    row = rows_of("task.max_terms=4")["sequence alone"]  # prompts of several lengths: padding to leak
    assert row.ok is False and "float64" in row.measured, row


@pytest.mark.slow  # two checks (~10 s each)
def test_past_the_tolerance_ranks_is_decided_in_float64_and_a_per_rank_normaliser_still_fails(monkeypatch):
    """SmolLM2 on a probe of 4 rows sums its two ranks' gradients 1.5e-5 off one rank's; the float64 comparison
    decides. Forced here with a tolerance below 0 on the tiny model (its two halves are often bit-equal)."""
    from rlrun.check import probes

    monkeypatch.setattr(probes, "FP_TOL", -1.0)
    row = rows_of()["ranks"]
    assert row.ok is True and "float64" in row.measured, row
    assert float(row.measured.rsplit("float64 ", 1)[1]) < 1e-12, row.measured  # rounding vanishes in float64
    normalised_per_rank(monkeypatch)
    row = rows_of()["ranks"]
    assert row.ok is False and "float64" in row.measured, row


@pytest.mark.slow  # three checks (~10 s each)
def test_under_bf16_past_the_tolerance_float64_decides_and_a_real_error_still_fails(monkeypatch):
    """SmolLM2 in bf16 put two ranks' gradients 0.24 apart and a sequence's logprobs 0.22 apart in its batch and
    alone, past bf16's tolerances, in a right configuration: 30 layers of bf16 rounding. Past them the float64
    arbiter decides, and the bf16 side is held to bf16's own rounding. Forced here with tolerances below 0 on the
    tiny model: right configurations pass, a per-rank normaliser, attended padding and a loss normalised twice fail."""
    from rlrun.check import probes

    monkeypatch.setattr(probes, "BF16_TOL", -1.0)
    monkeypatch.setattr(probes, "BF16_LOGPROB_TOL", -1.0)
    bf16 = ("train.precision=bf16", "task.max_terms=4", "train.micro_batch=2")
    rows = rows_of(*bf16)
    for name in ("accumulation", "ranks", "sequence alone"):
        assert rows[name].ok is True and "reference way" in rows[name].measured, rows[name]
        assert float(rows[name].measured.rsplit("float64 ", 1)[1]) < 1e-12, rows[name].measured
    normalised_per_rank(monkeypatch)
    padding_attended(monkeypatch)
    rows = rows_of(*bf16)
    assert rows["ranks"].ok is False and rows["sequence alone"].ok is False, (rows["ranks"], rows["sequence alone"])
    monkeypatch.undo()
    monkeypatch.setattr(probes, "BF16_TOL", -1.0)
    normalised_twice(monkeypatch)
    assert rows_of(*bf16)["accumulation"].ok is False


@pytest.mark.slow  # two checks (~10 s each)
def test_past_the_tolerance_generator_vs_trainer_is_judged_by_rounding_and_stale_weights_still_fail(monkeypatch):
    """SmolLM2 in bf16: the generator's logprobs 0.19 off the trainer's at the same weights, each side that far
    from the trainer's float64 logprobs (0.21 and 0.16): rounding. Past the tolerance the generator may be at most
    4x the trainer's rounding from float64; a generator a step behind (trl#5312's class) is off by the step."""
    from rlrun.check import probes

    monkeypatch.setattr(probes, "BF16_LOGPROB_TOL", -1.0)  # the tiny model's two paths are bit-equal: force it
    bf16 = ("train.precision=bf16", "rollout.pipeline=async")  # a generator of its own, synced
    row = rows_of(*bf16)["generator = trainer"]
    assert row.ok is True and "vs float64" in row.measured, row
    generator_off_by_a_step(monkeypatch)
    row = rows_of(*bf16)["generator = trainer"]
    assert row.ok is False and "vs float64" in row.measured, row


@pytest.mark.slow  # two checks (~10 s each)
def test_past_the_tolerance_the_sampler_filter_is_judged_by_rounding_and_a_filtered_sampler_still_fails(monkeypatch):
    """SmolLM2 in bf16 (tiled, packed): the importance weights' mean 1.0059, past bf16's 5e-3, in a right
    configuration. Past it the trainer's float64 logprobs arbitrate: the generator's weights against them may be at
    most 4x the trainer's own; a sampler that drew from a top-p-filtered distribution the trainer does not score
    (trl#6789) is off by the kept mass on every token."""
    from rlrun.check import probes

    monkeypatch.setattr(probes, "BF16_WEIGHT_TOL", -1.0)  # the tiny model's bf16 meets 5e-3: force the arbiter
    bf16 = ("train.precision=bf16", "rollout.top_p=0.8")
    row = rows_of(*bf16)["sampler filter"]
    assert row.ok is True and "vs float64" in row.measured, row
    full_distribution(monkeypatch)
    row = rows_of(*bf16)["sampler filter"]
    assert row.ok is False and "vs float64" in row.measured, row


@pytest.mark.slow  # two checks (~10 s each)
def test_under_bf16_vs_baseline_holds_an_option_to_bf16s_rounding_of_the_baseline(monkeypatch):
    """vs baseline under bf16 (SmolLM2: gradients 0.25 of their largest entry off fp32's, the loss 3e-3): each
    quantity (the loss, each gradient, the logprobs) may be no further from the baseline's float64 step than
    PRECISION_SLACK times the baseline's own under bf16 (rlrun/check/quantities.py). An option whose bf16 path
    rounds far worse than that (its gradients scaled by 1 + 0.5 outside float64) fails; the right one passes."""
    from rlrun.check import probes

    row = rows_of("train.precision=bf16", "head=chunked")["vs baseline"]  # under bf16: always the arbiter
    assert row.ok is True and "vs fp64" in row.measured, row
    step = probes.train_step

    def worse(model, micros, ax, *a, **k):
        loss, parts, grads = step(model, micros, ax, *a, **k)
        if ax.head.impl.TILED and next(model.parameters()).dtype != torch.float64:
            grads = {n: g * 1.5 for n, g in grads.items()}
        return loss, parts, grads

    monkeypatch.setattr(probes, "train_step", worse)
    row = rows_of("train.precision=bf16", "head=chunked")["vs baseline"]
    assert row.ok is False and "over:" in row.measured, row


def test_the_float64_arbiter_decides_under_activations_checkpoint(monkeypatch):
    """SmolLM2, activations=checkpoint: the ranks probe's float64 arbiter raised CheckpointError (a checkpointed
    layer's recompute runs in autograd's engine, outside the float64 mode, so it recomputed in float32). The
    arbiter's copy keeps its activations (the same numbers); the configuration's own trainer still checkpoints."""
    from rlrun import activations
    from rlrun.check import float64, probes

    monkeypatch.setattr(probes, "FP_TOL", -1.0)
    ctx = check.build(validate(make_cfg("experiment=smoke", "activations=checkpoint")))
    row = probes.ranks(ctx)
    assert row.ok is True and "float64" in row.measured, row
    assert float(row.measured.rsplit("float64 ", 1)[1]) < 1e-12, row.measured
    assert activations.checkpointed(ctx.trainer)  # only the arbiter's copy was unwrapped
    assert float64.in_float64(ctx.trainer, activations.checkpointed) == []


@pytest.mark.slow  # two checks (~10 s each)
def test_past_the_tolerance_accumulation_is_decided_in_float64_and_a_loss_normalised_twice_still_fails(monkeypatch):
    """SmolLM2 on an H200 splits a step 3.7e-5 off one micro-batch (CUDA's kernels, two batch shapes); the float64
    comparison decides. Forced here with a tolerance below 0 on the tiny model."""
    from rlrun.check import probes

    monkeypatch.setattr(probes, "FP_TOL", -1.0)
    row = rows_of("train.micro_batch=2")["accumulation"]
    assert row.ok is True and "float64" in row.measured, row
    assert float(row.measured.rsplit("float64 ", 1)[1]) < 1e-12, row.measured  # rounding vanishes in float64
    normalised_twice(monkeypatch)
    row = rows_of("train.micro_batch=2")["accumulation"]
    assert row.ok is False and "float64" in row.measured, row


def test_the_float64_arbiter_rounds_nothing_to_float32_though_the_model_casts():
    """transformers' Llama normalises in float32 (RMSNorm casts its input down, the rotary embedding calls .float()):
    a float64 copy alone still rounds there, and on a GPU two batch shapes' float64 sums then part by float32's ulp
    (SmolLM2 on an H200: sequence alone 8.4e-7 "in float64"). Under the arbiter no op yields a float32 tensor, in
    the forward or the backward of a train step, and the loss is the one a float64 RMSNorm gives."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from rlrun.check import float64, probes

    class Float32Outputs(TorchDispatchMode):  # ops that round: a float64 tensor in, a float32 tensor out
        def __init__(self):
            super().__init__()
            self.ops: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            dtypes = lambda x: {t.dtype for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)}  # noqa: E731
            if torch.float64 in dtypes((args, kwargs)) and torch.float32 in dtypes(out):
                self.ops.add(str(func))
            return out

    ctx = check.build(validate(make_cfg("experiment=smoke")))
    old = [o.double() for o in probes.old_logprobs(ctx.baseline, ctx.micros, ctx.base_axes)]

    def step(exact):
        seen = Float32Outputs()
        with seen:
            loss, _, grads = probes.train_step(exact, ctx.micros, ctx.base_axes, ctx.meter, old)
        return seen.ops, loss, grads

    plain, plain_loss, _ = step(probes.copy_model(ctx.baseline).double())  # the model's own float32 casts
    assert plain == {"aten._to_copy.default"}, plain
    ops, loss, grads = float64.in_float64(ctx.baseline, step)
    assert ops == set(), ops
    assert all(g.dtype == torch.float64 for g in grads.values())
    assert loss != plain_loss  # the norms' float32 rounding is gone from the loss
    with float64.KeepFloat64():  # what transformers 5.17's rotary embedding does: float64 operands on both sides
        freqs = torch.ones(4, 1, dtype=torch.float64).float() @ torch.arange(3)[None].float()
        made = [torch.zeros(2), torch.ones(2, dtype=torch.float32), torch.arange(2).to(torch.float32)]
    assert freqs.dtype == torch.float64 and {t.dtype for t in made} == {torch.float64}
    assert torch.get_default_dtype() == torch.float32 and torch.arange(2).float().dtype == torch.float32


# -- issue #53: no crash, no false alarm ------------------------------------------------------------------------------

def tiled_drops_its_partial_tile(monkeypatch):
    """The tiles of a head cover only whole tiles: the last partial one's tokens are lost (their logprobs and
    gradients never computed)."""
    from rlrun.heads import chunked, common, tiled

    whole = lambda n, size: [slice(i, i + size) for i in range(0, n - size + 1, size)] or [slice(0, 0)]  # noqa: E731
    for module in (common, chunked, tiled):
        if hasattr(module, "tiles"):
            monkeypatch.setattr(module, "tiles", whole)


@pytest.mark.slow  # a check (~10 s)
def test_a_probe_that_raises_is_its_own_failed_row_not_a_traceback(monkeypatch):
    """head.size=20 with the partial tile dropped raised an IndexError out of `rlrun check` (issue #53): now each
    probe it breaks is a FAIL row carrying the exception, and the others still give their verdicts."""
    tiled_drops_its_partial_tile(monkeypatch)
    cfg = validate(make_cfg("experiment=smoke", "head=tiled", "head.size=20"))
    with torch.random.fork_rng():
        rows = check.run_probes(check.build(cfg))
    got = {r.probe: r for r in rows}
    assert set(got) == set(DPO_PROBES)
    raised = [r for r in rows if r.measured.startswith("raised ")]
    assert raised and all(r.ok is False for r in raised), [(r.probe, r.measured) for r in rows]
    assert got["on-policy ratio"].ok is False and got["vs baseline"].ok is False


def test_the_logits_detector_follows_the_head_weight_not_a_vocabulary_wide_shape():
    """A [4, 56, 56] attention score of a pack as wide as the vocabulary (56) is no product of the lm head; logits
    are, in any dtype the head casts the weight to."""
    weight, hidden = torch.nn.Parameter(torch.randn(56, 32)), torch.randn(4, 56, 32, requires_grad=True)
    with check.probes.HeadProducts(weight) as watch:
        torch.bmm(torch.randn(4, 56, 32), torch.randn(4, 32, 56)).softmax(-1)  # attention: the vocabulary's width
        assert watch.rows == 0
        torch.nn.functional.linear(hidden[:, :3], weight).sum().backward()  # a tile of 4 x 3 tokens
        assert watch.rows == 12
        torch.nn.functional.linear(hidden.bfloat16(), weight.bfloat16())  # the full logits, through a cast
        assert watch.rows == 4 * 56


@pytest.mark.slow  # a DPO check of the varied-lengths task (~10 s)
def test_a_pack_as_wide_as_the_vocabulary_is_no_false_alarm():
    """issue #53: `loss=dpo head=chunked batching=shared_prompt train.precision=bf16 experiment=varied_lengths`
    failed `no full logits` on a correct head: its [4, 56, 56] attention mask was counted as logits."""
    cfg = validate(make_cfg("loss=dpo", "head=chunked", "batching=shared_prompt", "train.precision=bf16",
                            "experiment=varied_lengths"))
    got = {r.probe: r for r in check.rows_of(cfg)}
    assert got["no full logits"].ok is True, got["no full logits"]
    assert all(r.ok is not False for r in got.values()), {p: r.measured for p, r in got.items() if r.ok is False}


@pytest.mark.slow  # two checks refused before any probe, one bounded check (~15 s)
def test_check_refuses_what_the_run_refuses_and_stays_within_its_documented_size(tmp_path):
    """issue #54: `rollout.max_new_tokens=1000` beyond the tiny model's 256 positions passed every probe while the
    run refused it; a group of 65,536 kept the check busy for minutes at gigabytes (documented: at most 16
    sequences)."""
    r = subprocess.run([sys.executable, "-m", "rlrun", "check", "experiment=smoke", "rollout.max_new_tokens=1000"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "context" in r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    cfg = validate(make_cfg("experiment=smoke", "train.group_size=65536", "train.rollout_batch=65536",
                            "train.batch_size=65536", "train.micro_batch=8"))
    with torch.random.fork_rng():
        ctx = check.build(cfg)
    assert ctx.roll.input_ids.shape[0] == check.PROBE_ROWS
