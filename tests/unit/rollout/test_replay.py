"""rollout.record=DIR and rollout=replay (rlrun/rollout/record.py, replay.py; docs/replay.md): a replay of the recorded
config is the recorded run bit for bit; training-side variants replayed agree with it to fp tolerance over every
step; what a record fixes is refused by key; a changed, torn or short record is refused by file; a killed recording
run resumed records the same rollouts, and a resumed replay trains the same."""

import hashlib
import json

import pytest
import torch
from conftest import make_cfg, new_store
from helpers import runs

from rlrun import cli
from rlrun.config import validate
from rlrun.errors import RecordError
from rlrun.rollout import record, replay

# two iterations per rollout and a KL term: the old and reference passes run on the replayed rollouts too; a constant
# learning rate, so that a run of 2 steps resumed to 4 is the run of 4 (a cosine schedule depends on train.steps)
BASE = ["experiment=smoke", "train.steps=4", "train.num_iterations=2", "loss.kl_coef=0.05", "export.enabled=false",
        "train.lr_schedule=constant"]


def run(folder, *overrides):
    """One in-process run tracked into folder/mlflow.db; -> {MLflow key: [(step, value)]} of its train/* and eval/*
    metrics."""
    new_store(folder)
    cli.run(make_cfg(*BASE, *overrides, tmp_path=folder), "replay-test")
    client, (r,) = runs(folder / "mlflow.db")
    keys = [k for k in r.data.metrics if k.startswith(("train/", "eval/"))]
    return r, {k: [(m.step, m.value) for m in sorted(client.get_metric_history(r.info.run_id, k),
                                                     key=lambda m: m.step)] for k in keys}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A recorded smoke run: (its folder, the record's folder, its curves)."""
    folder = tmp_path_factory.mktemp("recorded")
    with pytest.MonkeyPatch.context() as mp:  # set up before each test's own working folder: MLflow's ./mlruns
        mp.chdir(folder)
        r, curves = run(folder, f"rollout.record={folder}/record")
    assert r.data.tags["rlrun.record"] == str(folder / "record")
    assert dataset_of(r, "recorded") == (hashlib.sha256((folder / "record" / record.INDEX).read_bytes()).hexdigest(), 2)
    return folder, folder / "record", curves


def dataset_of(r, context: str):
    """(the full sha256, the rollouts) of the run's one dataset input, which must be the record with `context`."""
    (given,) = r.inputs.dataset_inputs
    assert given.dataset.name == "rollouts record" and given.dataset.source_type == "local"
    assert [(t.key, t.value) for t in given.tags] == [("mlflow.data.context", context)]
    profile = json.loads(given.dataset.profile)
    assert given.dataset.digest == profile["sha256"][:16]
    return profile["sha256"], profile["rollouts"]


@pytest.mark.slow  # two short runs (the recorded one is the module's)
def test_replaying_the_recorded_config_reproduces_every_curve_bit_for_bit(recorded, tmp_path):
    _, rec, curves = recorded
    r, again = run(tmp_path, "rollout=replay", f"rollout.path={rec}")
    assert again == curves  # train/* and eval/*: every key, step and value
    assert len(curves["train/loss"]) == 4 and any(v for _, v in curves["train/grad_norm"])
    assert r.data.tags["rlrun.replay.digest"] == hashlib.sha256((rec / record.INDEX).read_bytes()).hexdigest()
    assert dataset_of(r, "replay") == (r.data.tags["rlrun.replay.digest"], 2)  # the run page's Datasets
    assert "system/time/generate_s" not in r.data.metrics  # nothing generated; the read is the wait phase


@pytest.mark.slow  # an async run (its generator process) and its replay
def test_an_async_run_recorded_replays_as_it_trained_stale_rollouts_included(tmp_path):
    """rollout.pipeline=async records its rollouts as the trainer takes them, each with the older weights version
    that drew it; the replay (in step, no generator) trains those stale rollouts to the async run's curves."""
    _, curves = run(tmp_path / "async", "rollout.pipeline=async", "rollout.max_staleness=1", "train.num_iterations=1",
                    f"rollout.record={tmp_path}/rec")
    entries = record.read_index(str(tmp_path / "rec"))
    assert [e["step"] for e in entries] == [0, 1, 2, 3]
    assert [e["version"] for e in entries] == [0, 0, 1, 2]  # up to one step behind: rollout n drawn ahead
    _, again = run(tmp_path / "replay", "rollout=replay", f"rollout.path={tmp_path}/rec", "train.num_iterations=1")
    assert again == curves  # train/* and eval/*: staleness and the sampler mismatch included
    assert max(v for _, v in curves["train/staleness_max"]) == 1


@pytest.mark.slow  # a LoRA run recorded, its replay, and a LoRA replay of the full-weights record
def test_lora_records_replays_bit_for_bit_and_is_free_on_a_replay(recorded, tmp_path):
    """LoRA (adapters trained, the reference its adapters off) records and replays as any run; and `model.lora` is
    the training side: a full-weights record replays with adapters on, on its rewards, its rollouts' versions."""
    _, curves = run(tmp_path / "lora", "model.lora.enabled=true", f"rollout.record={tmp_path}/rec")
    _, again = run(tmp_path / "replay", "model.lora.enabled=true", "rollout=replay", f"rollout.path={tmp_path}/rec")
    assert again == curves
    _, rec, full = recorded
    _, adapters = run(tmp_path / "on-full", "model.lora.enabled=true", "rollout=replay", f"rollout.path={rec}")
    assert adapters["train/reward_mean"] == full["train/reward_mean"]  # the record's rollouts, trained otherwise
    assert adapters["train/grad_norm"] != full["train/grad_norm"]


@pytest.mark.slow
@pytest.mark.parametrize("variant", [["head=chunked", "head.size=16"], ["batching=packed", "batching.max_tokens=48"],
                                     ["activations=checkpoint", "train.micro_batch=2"]],
                         ids=["chunked", "packed", "checkpoint-micro2"])
def test_training_side_variants_replayed_agree_with_the_record_over_every_step(recorded, tmp_path, variant):
    """Exact axes on the same rollouts: the curves coincide to fp tolerance over the whole run (without replay they
    part once rounding flips a sampled token)."""
    _, rec, curves = recorded
    _, got = run(tmp_path, "rollout=replay", f"rollout.path={rec}", *variant)
    for key in ("train/loss", "train/grad_norm", "train/reward_mean", "train/clipfrac", "train/kl",
                "train/mismatch/gen_vs_train_abs"):
        if key not in curves:
            continue
        assert [s for s, _ in got[key]] == [s for s, _ in curves[key]], key
        assert [v for _, v in got[key]] == pytest.approx([v for _, v in curves[key]], rel=1e-5, abs=1e-7), key
    assert got["train/reward_mean"] == curves["train/reward_mean"]  # the recorded rewards themselves


def test_what_the_record_fixes_is_refused_by_key_and_a_short_record_by_its_length(tmp_path):
    (tmp_path / "rec").mkdir()
    cfg = validate(make_cfg(*BASE, "rollout=replay", f"rollout.path={tmp_path}/rec"))
    (tmp_path / "rec" / record.HEADER).write_text(json.dumps({"format": record.FORMAT, "fixed": record.fixed(cfg)}))
    with pytest.raises(RecordError, match="train.steps=4 needs 2 rollouts and the record holds 0"):
        replay.check(cfg)
    other = validate(make_cfg(*BASE, "rollout=replay", f"rollout.path={tmp_path}/rec", "rollout.temperature=0.7",
                              "train.group_size=2", "model.hidden_size=48", "head=tiled", "loss=cispo"))
    with pytest.raises(RecordError) as e:
        replay.check(other)
    named = [line.split()[1] for line in str(e.value).splitlines()[1:]]  # "  - KEY was ..." / "  - train.steps=4 ..."
    assert named == ["model.hidden_size", "rollout.temperature", "train.group_size", "train.steps=4"], str(e.value)
    assert "rollout.temperature was 1.0 in the record, now 0.7" in str(e.value)  # head, loss: the training side


def header_of(folder, cfg) -> None:
    """A record at `folder` whose header fixes what `cfg` draws its rollouts with (no rollouts)."""
    folder.mkdir(exist_ok=True)
    (folder / record.HEADER).write_text(json.dumps({"format": record.FORMAT, "fixed": record.fixed(cfg)}))


def problems_of(cfg) -> list[str]:
    with pytest.raises(RecordError) as e:
        replay.check(cfg)
    return [line.strip("- ") for line in str(e.value).splitlines()[1:]]


def test_a_replay_with_another_warm_start_is_refused_naming_it(tmp_path):
    """A record drawn without a warm start, replayed with warm_start.enabled=true: the trainer's weights were not
    the sampler's (token probability ratios of 454-750) and the run finished without a word."""
    overrides = [*BASE, "train.steps=1", "rollout=replay", f"rollout.path={tmp_path}/rec"]
    header_of(tmp_path / "rec", validate(make_cfg(*overrides, "warm_start.enabled=false")))
    said = problems_of(validate(make_cfg(*overrides, "warm_start.enabled=true")))
    assert said[0] == "warm_start.applies was False in the record, now True", said
    said = problems_of(validate(make_cfg(*overrides, "warm_start.enabled=false", "warm_start.steps=7")))
    assert [p.split()[0] for p in said] == ["train.steps=1"], said  # not applied: its settings change nothing


def test_a_replay_after_the_weights_at_model_path_changed_is_refused_naming_their_digest(tmp_path):
    """The same model.path, other weights (a mismatch of 66,695 at step 0, finished rc 0 without a word)."""
    from helpers import tiny_model

    model, tok = tiny_model()
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    overrides = [*BASE, "train.steps=1", "model=hf", f"model.path={tmp_path}/model", "rollout=replay",
                 f"rollout.path={tmp_path}/rec"]
    cfg = validate(make_cfg(*overrides))
    header_of(tmp_path / "rec", cfg)
    assert record.fixed(cfg)["model"]["weights_sha256"]  # a folder's weights are digested
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    model.save_pretrained(tmp_path / "model")  # the same path, new weights
    said = problems_of(cfg)
    assert said[0].startswith("model.weights_sha256 was '"), said
    assert len(said) == 2 and said[1].startswith("train.steps=1 needs 1 rollouts")  # nothing else differs


def test_a_record_folder_that_is_a_link_to_nothing_is_refused_before_the_run(tmp_path):
    """It passed the check and the recorder's makedirs failed on it once the run had started."""
    (tmp_path / "rec").symlink_to(tmp_path / "gone")
    cfg = validate(make_cfg(*BASE, f"rollout.record={tmp_path}/rec"))
    with pytest.raises(RecordError, match="is a symbolic link to nothing"):
        record.check_folder(str(tmp_path / "rec"), cfg, resumed=False)
    assert not (tmp_path / "gone").exists()


def test_a_record_that_is_not_one_is_refused_naming_the_file(tmp_path):
    with pytest.raises(RecordError, match="is not a folder"):
        record.Record(str(tmp_path / "missing"))
    (tmp_path / "r").mkdir()
    with pytest.raises(RecordError, match="record.json cannot be read"):
        record.Record(str(tmp_path / "r"))
    (tmp_path / "r" / record.HEADER).write_text(json.dumps({"format": 99, "fixed": {}}))
    with pytest.raises(RecordError, match="record format 99"):
        record.Record(str(tmp_path / "r"))
    (tmp_path / "r" / record.HEADER).write_text(json.dumps({"format": record.FORMAT, "fixed": {}}))
    (tmp_path / "r" / record.INDEX).write_text('{"n": 0, "file": "a", "sha256": "x", "step": 0, "version": 0}\n{"n": 1')
    with pytest.raises(RecordError, match="line 2 is not the record of rollout 1"):
        record.Record(str(tmp_path / "r"))


@pytest.mark.slow
def test_a_changed_rollout_file_is_refused_naming_it(recorded, tmp_path):
    import shutil

    _, rec, _ = recorded
    copy = tmp_path / "rec"
    shutil.copytree(rec, copy)
    data = bytearray((copy / "rollout_000001.safetensors").read_bytes())
    data[-1] ^= 1  # one bit of the last rollout's last float
    (copy / "rollout_000001.safetensors").write_bytes(bytes(data))
    with pytest.raises(RecordError, match="rollout_000001.safetensors is missing or changed"):
        run(tmp_path / "run", "rollout=replay", f"rollout.path={copy}")


def test_a_record_folder_is_new_empty_or_this_runs_own_when_it_resumes(tmp_path):
    cfg = validate(make_cfg(*BASE))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    with pytest.raises(RecordError, match="a folder with other files"):
        record.check_folder(str(tmp_path / "full"), cfg, resumed=False)
    assert record.check_folder(str(tmp_path / "new"), cfg, resumed=False) == []
    record.Recorder(str(tmp_path / "rec"), cfg, resumed=False)
    with pytest.raises(RecordError, match="holds a record already"):
        record.check_folder(str(tmp_path / "rec"), cfg, resumed=False)
    assert record.check_folder(str(tmp_path / "rec"), cfg, resumed=True) == []
    other = validate(make_cfg(*BASE, "seed=1"))
    with pytest.raises(RecordError, match="seed was 0 in the record, now 1"):
        record.check_folder(str(tmp_path / "rec"), other, resumed=True)


def test_record_and_replay_are_refused_with_dpo_and_accepted_on_several_ranks(monkeypatch):
    from rlrun.config import ConfigError

    with pytest.raises(ConfigError, match="loss=dpo generates none"):
        validate(make_cfg("loss=dpo", "rollout.record=/tmp/r"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    for given in (["rollout=replay", "rollout.path=/tmp/r"], ["rollout.record=/tmp/r"]):
        validate(make_cfg("experiment=smoke", "engine=deepspeed", *given))


def ragged_share(rank: int, prompt: int, response: int, pad: int = 0):
    """One rank's share of a rollout as parts_of gives it: 2 rows, prompts left-padded to `prompt`, responses
    right-padded to `response` (row 1 shorter on both sides), values that say where they came from."""
    import torch

    ids = torch.full((2, prompt + response), pad)
    mask = torch.zeros(2, prompt + response, dtype=torch.long)
    for row, (p, r) in enumerate([(prompt, response), (prompt - 1, response - 1)]):
        ids[row, prompt - p:prompt + r] = 100 * rank + 10 * row + torch.arange(1, p + r + 1)
        mask[row, prompt - p:prompt + r] = 1
    tensors = {"input_ids": ids, "attention_mask": mask, "response_mask": mask[:, prompt:].clone(),
               "gen_logprobs": -mask[:, prompt:].float() * (rank + 1), "finished": torch.tensor([1, 0])}
    meta = {"prompt_len": prompt, "rows": [{"prompt": f"r{rank}"}] * 2, "completions": [f"c{rank}a", f"c{rank}b"],
            "totals": [float(rank), 0.5], "by_reward": {"r": [float(rank), 0.5]}}
    return tensors, meta


def test_the_ranks_shares_join_into_one_rollout_and_each_rank_takes_its_share_back():
    """Data parallel: rank 0 writes the shares of 2 ranks as one rollout, padded as one process pads (to the widest
    prompt, left, and the longest response, right); a replaying rank's share of it is what that rank had, to the
    column: the widths it pads its own rollout to."""
    import torch

    parts = [ragged_share(0, prompt=4, response=3), ragged_share(1, prompt=2, response=5)]
    whole, meta = record.join(parts, pad_id=0)
    assert whole["input_ids"].shape == (4, 4 + 5) and meta["prompt_len"] == 4
    assert meta["completions"] == ["c0a", "c0b", "c1a", "c1b"] and meta["by_reward"] == {"r": [0.0, 0.5, 1.0, 0.5]}
    assert whole["attention_mask"][2:, :2].eq(0).all()  # rank 1's prompts, 2 wide, left-padded to 4
    for rank, (tensors, m) in enumerate(parts):
        got, got_meta = record.share(whole, meta, rank, world=2)
        assert got_meta == m
        for k in record.TENSORS:
            assert torch.equal(got[k], tensors[k]), (rank, k)
    one, _ = record.share(whole, meta, 0, world=1)
    assert all(torch.equal(one[k], whole[k]) for k in record.TENSORS)


@pytest.mark.slow  # four short runs
def test_a_resumed_recording_records_the_same_and_a_resumed_replay_trains_the_same(recorded, tmp_path):
    """Two steps, then resume=true to four: the record equals the uninterrupted run's file for file; a replay
    stopped after two steps and resumed gives the uninterrupted replay's curves."""
    _, rec, curves = recorded
    ckpt = f"checkpoint.dir={tmp_path}/ckpt"
    run(tmp_path / "a", f"rollout.record={tmp_path}/rec", ckpt, "train.steps=2", "checkpoint.every=2")
    cli.run(make_cfg(*BASE, f"rollout.record={tmp_path}/rec", ckpt, "resume=true", tmp_path=tmp_path / "a"), "resumed")
    assert (tmp_path / "rec" / record.INDEX).read_text() == (rec / record.INDEX).read_text()
    assert sorted(p.name for p in (tmp_path / "rec").iterdir()) == sorted(p.name for p in rec.iterdir())

    ckpt = f"checkpoint.dir={tmp_path}/ckpt2"
    run(tmp_path / "c", "rollout=replay", f"rollout.path={rec}", ckpt, "train.steps=2", "checkpoint.every=2")
    cli.run(make_cfg(*BASE, "rollout=replay", f"rollout.path={rec}", ckpt, "resume=true", tmp_path=tmp_path / "c"),
            "resumed")
    client, (r,) = runs(tmp_path / "c" / "mlflow.db")
    for key in ("train/loss", "train/grad_norm", "train/reward_mean"):
        got = sorted(client.get_metric_history(r.info.run_id, key), key=lambda m: m.step)
        assert [(m.step, m.value) for m in got] == curves[key], key


def test_a_resumed_recorder_writes_again_from_its_checkpoints_rollout(tmp_path):
    """A run killed after recording rollouts its checkpoint does not hold: resumed, the recorder cuts the index back
    to the checkpoint's rollout and writes on from there (the same rollouts again: a resume is bit-identical)."""
    import torch

    from rlrun.recipes.sampling import Drawn
    from rlrun.rollout import Rollout

    cfg = validate(make_cfg(*BASE))

    def drawn(k):
        ids = torch.full((2, 3), k)
        roll = Rollout(ids, torch.ones(2, 3, dtype=torch.long), 1, torch.ones(2, 2, dtype=torch.bool),
                       torch.full((2, 2), -0.5 * k), [f"c{k}", "d"], torch.tensor([True, False]))
        return Drawn([{"prompt": "1+1=", "answer": "2"}] * 2, roll, [1.0, 0.0], {"r": [1.0, 0.0]}, torch.zeros(2))

    first = record.Recorder(str(tmp_path), cfg, resumed=False)
    for n in range(3):
        first.write(n, *record.parts_of(drawn(n)), version=n, step=n)
    # a run killed while it wrote rollout 2 left its temporary file; the resumed run removes it, nothing else
    (tmp_path / "rollout_000002.safetensors.tmp5219").write_bytes(b"half a rollout")
    (tmp_path / "notes.tmp1").write_text("not the record's")
    again = record.Recorder(str(tmp_path), cfg, resumed=True)  # the checkpoint had consumed rollout 0 only
    assert not (tmp_path / "rollout_000002.safetensors.tmp5219").exists() and (tmp_path / "notes.tmp1").exists()
    again.write(1, *record.parts_of(drawn(7)), version=1, step=1)
    entries = record.read_index(str(tmp_path))
    assert [e["n"] for e in entries] == [0, 1] and entries[0] == first.entries[0]
    tensors, meta = record.Record(str(tmp_path)).read(1, "cpu")
    assert tensors["input_ids"].eq(7).all() and meta["completions"] == ["c7", "d"] and meta["version"] == 1
    assert tensors["finished"].tolist() == [True, False] and tensors["response_mask"].dtype == torch.bool
    with pytest.raises(RecordError, match="holds 2 rollouts and this run is at rollout 3"):
        again.write(3, *record.parts_of(drawn(3)), version=3, step=3)


@pytest.mark.slow  # builds the configuration and its baseline, draws a probe rollout (~10 s)
def test_rlrun_check_passes_on_a_replay_of_training_side_options(recorded):
    """A replay has no sampler: `rlrun check` draws its probe with rollout=hf at the replay's settings and proves
    the training side (here chunked + packed + checkpointed activations)."""
    import torch

    from rlrun import check

    _, rec, _ = recorded
    cfg = validate(make_cfg(*BASE, "rollout=replay", f"rollout.path={rec}", "head=chunked", "batching=packed",
                            "activations=checkpoint"))
    with torch.random.fork_rng():
        rows = check.run_probes(check.build(cfg))
    assert rows and all(r.ok is not False for r in rows), [(r.probe, r.ok) for r in rows]
    assert any(r.probe == "vs baseline" and r.ok for r in rows)


def test_a_rollout_file_of_another_layout_is_refused_naming_it(tmp_path):
    import torch
    from safetensors.torch import save

    data = save({k: torch.zeros(1, 2) for k in record.TENSORS})  # no `rlrun` metadata: not this format's rollout
    (tmp_path / "rollout_000000.safetensors").write_bytes(data)
    (tmp_path / record.HEADER).write_text(json.dumps({"format": record.FORMAT, "fixed": {}}))
    (tmp_path / record.INDEX).write_text(json.dumps({"n": 0, "file": "rollout_000000.safetensors", "sha256":
                                                     hashlib.sha256(data).hexdigest(), "step": 0, "version": 0}) + "\n")
    with pytest.raises(RecordError, match="rollout_000000.safetensors is not a rollout of record format 2"):
        record.Record(str(tmp_path)).read(0, "cpu")


def test_the_recorder_never_writes_through_a_link(tmp_path):
    """A link planted at the index's name is refused (rlrun.nofollow), and the file it points to is untouched."""
    import torch

    from rlrun.errors import LinkError
    from rlrun.recipes.sampling import Drawn
    from rlrun.rollout import Rollout

    cfg = validate(make_cfg(*BASE))
    rec = record.Recorder(str(tmp_path / "rec"), cfg, resumed=False)
    (tmp_path / "theirs.txt").write_text("not rlrun's")
    (tmp_path / "rec" / record.INDEX).symlink_to(tmp_path / "theirs.txt")
    roll = Rollout(torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long), 1,
                   torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, 1), ["c"], torch.tensor([True]))
    with pytest.raises(LinkError):
        rec.write(0, *record.parts_of(Drawn([{"prompt": "p"}], roll, [1.0], {"r": [1.0]}, torch.zeros(1))), version=0,
                  step=0)
    assert (tmp_path / "theirs.txt").read_text() == "not rlrun's"


def test_a_record_fixes_only_what_rollouts_depend_on(tmp_path):
    """issue #53: a replay refused a changed task.reward_timeout_s, which no rollout depends on (a record holds the
    rewards it got); a record made before says it, and is still read."""
    (tmp_path / "rec").mkdir()
    cfg = validate(make_cfg(*BASE, "rollout=replay", f"rollout.path={tmp_path}/rec"))
    old = record.fixed(cfg)
    old["task"]["reward_timeout_s"] = cfg.task.reward_timeout_s  # as records of earlier versions hold it
    (tmp_path / "rec" / record.HEADER).write_text(json.dumps({"format": record.FORMAT, "fixed": old}))
    longer = validate(make_cfg(*BASE, "rollout=replay", f"rollout.path={tmp_path}/rec",
                               f"task.reward_timeout_s={cfg.task.reward_timeout_s * 2}"))
    with pytest.raises(RecordError) as e:
        replay.check(longer)
    assert [line.split()[1] for line in str(e.value).splitlines()[1:]] == ["train.steps=4"], str(e.value)


@pytest.mark.slow  # two subprocesses (~5 s each)
@pytest.mark.parametrize("verb", ["plan", "check"])
def test_plan_and_check_refuse_a_config_that_cannot_replay_its_record(tmp_path, verb):
    """issue #53: `rlrun plan` and `rlrun check` with rollout=replay skipped the record's compatibility check that
    the run makes: both now refuse what the run refuses, with its message and exit 2."""
    import subprocess
    import sys

    (tmp_path / "rec").mkdir()
    cfg = validate(make_cfg(*BASE, "rollout=replay", f"rollout.path={tmp_path}/rec"))
    (tmp_path / "rec" / record.HEADER).write_text(json.dumps({"format": record.FORMAT, "fixed": record.fixed(cfg)}))
    r = subprocess.run([sys.executable, "-m", "rlrun", verb, *BASE, "rollout=replay", f"rollout.path={tmp_path}/rec",
                        "rollout.temperature=0.7", "tracking=none"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "cannot replay the record" in r.stderr and "rollout.temperature was 1.0 in the record, now 0.7" in r.stderr


def test_a_record_from_before_rollout_top_k_was_drawn_with_it_off():
    recorded = {"rollout.top_p": 1.0}
    assert record.differences(recorded, {"rollout.top_p": 1.0, "rollout.top_k": 0}) == []
    assert record.differences(recorded, {"rollout.top_p": 1.0, "rollout.top_k": 5}) == [
        "rollout.top_k was 0 in the record, now 5"]
