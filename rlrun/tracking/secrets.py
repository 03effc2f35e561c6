"""Values a config takes from the environment (`${oc.env:NAME}`) stay out of what a run logs: its name, params,
tags and config artifact show `${oc.env:NAME}` instead, unless `tracking.log_env=true` asks for the values. A
tracking server may be shared, and a token passed as `run_name=${oc.env:SECRET_TOKEN}` or
`task.path=${oc.env:DATA_URL}` would otherwise be readable by everyone who can read the experiment.

rlrun's own variables (`RLRUN_*`: the sweep's parent run id) are not secrets and are logged as they are.
"""

from __future__ import annotations

import os
import re
from typing import Any

from omegaconf import OmegaConf

ENV_REF = re.compile(r"\$\{oc\.env:([^,}]+)")
OWN = "RLRUN_"
# a value shorter than this is replaced only where a key names the variable itself: replaced wherever it appears in
# the text, a short value ("1", "cpu") would mangle unrelated params
MIN_ANYWHERE = 8


def references(config_obj) -> dict[str, str]:
    """{resolved value: `${oc.env:NAME}`} for each environment variable the config (a DictConfig) reads, beyond
    rlrun's own; empty when it reads none."""
    raw = OmegaConf.to_container(config_obj, resolve=False)
    found: dict[str, str] = {}
    for text in _strings(raw):
        for name in ENV_REF.findall(text):
            name = name.strip()
            value = os.environ.get(name)
            if value and not name.startswith(OWN):
                found[value] = f"${{oc.env:{name}}}"
    return found


def _strings(node) -> list[str]:
    if isinstance(node, dict):
        return [s for v in node.values() for s in _strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in _strings(v)]
    return [node] if isinstance(node, str) else []


def redact(resolved: Any, raw: Any, secrets: dict[str, str]) -> Any:
    """`resolved` (the resolved config as plain containers) with every value read from the environment shown as
    its `${oc.env:NAME}`: a leaf whose unresolved text reads the environment is that text; any other string has
    each long secret value (MIN_ANYWHERE characters or more: one reached through another interpolation) replaced."""
    if isinstance(resolved, dict):
        return {k: redact(v, raw.get(k) if isinstance(raw, dict) else None, secrets) for k, v in resolved.items()}
    if isinstance(resolved, list):
        return [redact(v, raw[i] if isinstance(raw, list) and i < len(raw) else None, secrets)
                for i, v in enumerate(resolved)]
    if isinstance(raw, str) and any(not n.strip().startswith(OWN) for n in ENV_REF.findall(raw)):
        return raw
    return text(resolved, secrets) if isinstance(resolved, str) else resolved


def text(value: str, secrets: dict[str, str]) -> str:
    """`value` with each long secret value in it replaced by its `${oc.env:NAME}`."""
    for secret, ref in sorted(secrets.items(), key=lambda kv: -len(kv[0])):
        if len(secret) >= MIN_ANYWHERE or value == secret:
            value = value.replace(secret, ref)
    return value


def loggable(config_obj, log_env: bool = False) -> tuple[dict, dict[str, str]]:
    """(the resolved config as plain containers, the secrets found) with the environment's values redacted, or as
    they are when `log_env`."""
    resolved = OmegaConf.to_container(config_obj, resolve=True)
    if log_env:
        return resolved, {}  # type: ignore[return-value]
    raw = OmegaConf.to_container(config_obj, resolve=False)
    return redact(resolved, raw, references(config_obj)), references(config_obj)
