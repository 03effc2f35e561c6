"""What MLflow's UI (3.x) opens on: links to the model-training runs view, the experiment's saved view `rlrun`
(metric columns, runs grouped by sweep) and the metric its charts start with.

MLflow 3.17's UI chooses GenAI or model training from the URL's `workflowType` (else from the browser's last
choice, GenAI by default); the experiment's `mlflow.experimentKind` tag is no longer read. Every link carries
`workflowType=machine_learning`. MLflow has no API for the runs table's default columns: the UI keeps them per
browser. What it does read from the store is a saved view, an experiment tag `mlflow.sharedViewState.<id>`
("Views" menu, or `viewStateShareKey=<id>` in the URL), and the tag `mlflow.experiment.primaryMetric.name`, the
chart its chart view puts first. A saved view cannot expand a parent run (MLflow drops `runsExpanded` from saved
views), so the view groups runs by the tag `rlrun.sweep_group`, which a sweep's parent and children share.
"""

from __future__ import annotations

import contextlib
import json
import time

VIEW_ID = "rlrun"
VIEW_TAG_PREFIX = "mlflow.sharedViewState."
VIEW_TAG = VIEW_TAG_PREFIX + VIEW_ID
VIEW_NAME = "rlrun: runs by sweep"
PRIMARY_METRIC_TAG = "mlflow.experiment.primaryMetric.name"
GROUP_TAG = "rlrun.sweep_group"  # a sweep's parent and children share it: the view's groups
# The runs table's metric columns: the learning curve (GRPO / DPO), held-out accuracy, the step's time and the
# run's memory peak.
METRIC_COLUMNS = ("train/reward_mean", "train/rewards/accuracy", "eval/accuracy", "system/summary/step_s",
                  "system/summary/peak_mib")
# A sweep job's answer in a few words (same result? cost vs the baseline: tools/verdict.brief), set at the sweep's
# end as this tag and as the first line of the job's description, which the Description column shows: an attribute
# column, so it sits before the metrics, in view without scrolling (a tag column comes after every param).
VERDICT_TAG = "rlrun.verdict"
ATTRIBUTE_COLUMNS = ("Description",)
# The chart view's first section: each job's answer as bars (tools/verdict.metrics, logged at the sweep's end), its
# memory peak and its learning curve's latest value. Where the view says so, MLflow keeps this section's place
# above the ones it makes for every metric (sorted by name). The sweep's printed `compare` link opens it.
ANSWER_SECTION = "rlrun-answer"
ANSWER_CHARTS = ("system/answer/cost_x", "system/answer/same", "system/summary/peak_mib")
MAX_TAG = 5000  # MLflow's limit on an experiment tag's value


def runs_page(base: str, exp_id: str) -> str:
    """The experiment's runs table on the model-training view, with rlrun's saved view."""
    return f"{base}/#/experiments/{exp_id}/runs?workflowType=machine_learning&viewStateShareKey={VIEW_ID}"


def run_page(base: str, exp_id: str, run_id: str) -> str:
    return f"{base}/#/experiments/{exp_id}/runs/{run_id}?workflowType=machine_learning"


def column(kind: str, key: str) -> str:
    """A runs-table column id as the UI spells it: metrics.`train/loss`, params.`head.name`."""
    return f"{kind}.`{key}`"


def param_of(config, key: str) -> str:
    """The logged param an override sets: a group option (`head=tiled`) is logged as `head.name`."""
    from omegaconf import DictConfig, OmegaConf

    node = OmegaConf.select(config, key, default=None) if isinstance(config, DictConfig) else None
    return f"{key}.name" if isinstance(node, DictConfig) and "name" in node else key


def compare_page(base: str, exp_id: str, view_id: str) -> str:
    """The runs page's chart view with a sweep's own saved view (sweep_view)."""
    return (f"{base}/#/experiments/{exp_id}/runs?workflowType=machine_learning&viewStateShareKey={view_id}"
            "&compareRunsMode=CHART")


def sweep_view(client, exp_id: str, run_id: str, group: str) -> str | None:
    """A saved view of the jobs of one sweep, whose parent run is `run_id` (the experiment's view `rlrun` with a
    search on the jobs' parent: an id, never a quote to escape; MLflow ignores a view whose link carries a search
    of its own, so the search is in the view); its id, or None where it could not be written."""
    with contextlib.suppress(Exception):  # a UI hint: never worth failing a sweep for
        tags = client.get_experiment(exp_id).tags
        state = read_view(tags)[0] or default_state()
        with_answer(state, tags.get(PRIMARY_METRIC_TAG, "train/reward_mean"))
        state["searchFilter"] = f"tags.mlflow.parentRunId = '{run_id}'"
        view_id = f"{VIEW_ID}-sweep-{run_id}"
        client.set_experiment_tag(exp_id, VIEW_TAG_PREFIX + view_id, envelope(state, name=f"rlrun: {group}"[:200]))
        return view_id
    return None


def answer_charts(primary: str) -> tuple[list[dict], dict]:
    """The bar charts of the chart view's first section and the section, as MLflow's UI state spells them."""
    charts = [{"uuid": f"{ANSWER_SECTION}-{i}", "type": "BAR", "runsCountToCompare": 10, "deleted": False,
               "isGenerated": False, "metricSectionId": ANSWER_SECTION, "metricKey": key}
              for i, key in enumerate((*ANSWER_CHARTS, primary))]
    # two columns: the cards' titles (the metric keys) stay readable beside MLflow's Assistant panel
    section = {"uuid": ANSWER_SECTION, "name": "rlrun: each job's answer (cost vs baseline, same result, memory)",
               "display": True, "isReordered": True, "deleted": False, "isGenerated": False, "columns": 2,
               "cardHeight": 250}
    return charts, section


def with_answer(state: dict, primary: str) -> bool:
    """Put the answer's section first in a saved view's chart state (False where it is already there)."""
    sections = state.setdefault("compareRunSections", [])
    if any(sec.get("uuid") == ANSWER_SECTION for sec in sections):
        return False
    charts, section = answer_charts(primary)
    state["compareRunCharts"] = charts + state.get("compareRunCharts", [])
    sections.insert(0, section)
    state["isAccordionReordered"] = True  # else MLflow sorts the sections by name
    return True


def default_state() -> dict:
    columns = [column("metrics", k) for k in METRIC_COLUMNS] + [column("attributes", k) for k in ATTRIBUTE_COLUMNS]
    return {"selectedColumns": columns, "columnOrder": [],
            "groupBy": {"aggregateFunction": "average", "groupByKeys": [{"mode": "tag", "groupByData": GROUP_TAG}]},
            # groups (sweeps) open by default; this opens the one of runs outside any sweep too
            "groupsExpanded": {f"tag.{GROUP_TAG}": True},
            "useGroupedValuesInCharts": False,  # each run's own curve, not the group's average
            "hideEmptyCharts": True}


def read_view(tags: dict) -> tuple[dict | None, int | None]:
    """(state, creation time) of the saved view `rlrun` in experiment tags `tags`; None where absent or unreadable."""
    try:
        saved = json.loads(tags[VIEW_TAG])
        return json.loads(saved["state"]), saved.get("createdAt")
    except (KeyError, TypeError, ValueError):
        return None, None


def prepare(client, exp_id: str, params: tuple[str, ...] = (), primary: str = "train/reward_mean") -> None:
    """The experiment's saved view `rlrun` with the metric columns and `params` as columns (added to what the view
    already shows: a user who saved over it keeps their changes), and the chart view's first chart `primary`
    unless the experiment names one. Two sweeps starting together may each miss the other's columns."""
    with contextlib.suppress(Exception):  # UI hints: never worth failing a run for
        tags = client.get_experiment(exp_id).tags
        if PRIMARY_METRIC_TAG not in tags:
            client.set_experiment_tag(exp_id, PRIMARY_METRIC_TAG, primary)
        state, created = read_view(tags)
        state = state or default_state()
        columns = state.setdefault("selectedColumns", [])
        fixed = [column("metrics", k) for k in METRIC_COLUMNS] + [column("attributes", k) for k in ATTRIBUTE_COLUMNS]
        new = [c for c in fixed + [column("params", p) for p in params] if c not in columns]
        charted = with_answer(state, tags.get(PRIMARY_METRIC_TAG, primary))
        if not new and not charted and VIEW_TAG in tags:
            return
        columns += new
        while len(columns) > len(fixed) and len(envelope(state, created)) > MAX_TAG:
            columns.pop(next(i for i, c in enumerate(columns) if c not in fixed))  # the oldest param columns
        client.set_experiment_tag(exp_id, VIEW_TAG, envelope(state, created))


def envelope(state: dict, created: int | None = None, name: str = VIEW_NAME) -> str:
    """A saved view as the UI stores it: name and times in plain JSON, the state as a JSON string."""
    now = int(time.time() * 1000)
    return json.dumps({"name": name, "createdAt": created or now, "updatedAt": now, "state": json.dumps(state)})
