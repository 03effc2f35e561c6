"""Secrets stay out of what a run logs and prints. A tracking server may be shared, and a token passed as
`run_name=${oc.env:SECRET_TOKEN}`, a password in `tracking.uri=http://user:PASSWORD@host` or one the shell expanded
into the command line would otherwise be readable by everyone who can read the experiment.

- Values a config takes from the environment (`${oc.env:NAME}`, in any spelling OmegaConf accepts: `${ oc.env:NAME }`
  too) are shown as `${oc.env:NAME}` in its name, params, tags and config artifact, unless `tracking.log_env=true`
  asks for the values (`loggable`).
- Every string written to MLflow (through `store.open_client`'s client: params, tags, run names, text artifacts) and
  every line the `rlrun` command prints (`Scrubbed`, `Filter`) passes `scrub`: a URI's password (`scheme://user:***@`),
  a secret-named query parameter's value (`?token=***`), the value of every environment variable named like a
  secret (`*TOKEN*`, `*SECRET*`, `*PASSWORD*`, `*KEY*`, ...: shown as `${oc.env:NAME}`), and the values the config
  read from the environment (`remember`).

rlrun's own variables (`RLRUN_*`: the sweep's parent run id) are not secrets and are logged as they are.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from typing import Any

from omegaconf import OmegaConf

ENV_REF = re.compile(r"\$\{\s*oc\.env\s*:\s*([^,}]+)")  # OmegaConf accepts spaces inside the braces
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


# (not PWD: the shell's working folder)
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW(OR)?D|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY|CREDENTIAL|AUTH", re.I)
# scheme://user:password@ (requests, MLflow and SQLAlchemy take credentials there): the password goes
USERINFO = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s:/@'\"]*):(?P<password>[^\s@/'\"]+)@")
# ?token=... &password=... &X-Amz-Signature=... (signed URLs, API keys in query strings): the value goes. A name is
# a secret's when it is one of these words, alone or after a `_`, `-` or `.` (`access_token`, `X-Amz-Signature`);
# not when the word ends a longer word (MLflow's own `viewStateShareKey` is no key)
QUERY = re.compile(r"(?P<head>[?&;](?:[\w.-]*[_.-])?(?:token|secret|passw(?:or)?d|pwd|api_?key|key|sig|signature|"
                   r"auth|credential|credentials)=)(?P<value>[^&#\s'\"]+)", re.I)
HIDDEN = "***"
KNOWN: dict[str, str] = {}  # values the loaded config read from the environment -> their `${oc.env:NAME}`


def remember(found: dict[str, str]) -> None:
    """The config's environment values (`references`), scrubbed from everything logged or printed from now on."""
    KNOWN.update(found)


def environment_secrets() -> dict[str, str]:
    """{value: `${oc.env:NAME}`} of every environment variable named like a secret whose value is long enough to be
    one (MIN_ANYWHERE characters: a short value would mangle unrelated text), beyond rlrun's own."""
    out = {}
    for k in names():
        v = os.environ.get(k)  # (None: removed since by another thread)
        if v and SECRET_NAME.search(k) and not k.startswith(OWN) and len(v) >= MIN_ANYWHERE:
            out[v] = f"${{oc.env:{k}}}"
    return out


def names() -> list[str]:
    """The environment's variable names. Other threads change the environment while this runs (MLflow's telemetry
    sets and removes _MLFLOW_TELEMETRY_SESSION_ID): iterating os.environ.items() then raised KeyError in a sweep's
    jobs, so the names are read alone, again if the table changed size meanwhile."""
    for _ in range(10):
        try:
            return list(os.environ)
        except RuntimeError:  # dictionary changed size during iteration
            continue
    return []


def scrub(value: str) -> str:
    """`value` with every secret this module knows of hidden (module docstring)."""
    if not value:
        return value
    value = USERINFO.sub(lambda m: f"{m['head']}:{HIDDEN}@", value)
    value = QUERY.sub(lambda m: f"{m['head']}{HIDDEN}", value)
    for secret, ref in sorted({**environment_secrets(), **KNOWN}.items(), key=lambda kv: -len(kv[0])):
        if len(secret) >= MIN_ANYWHERE:
            value = value.replace(secret, ref)
    return value


def scrub_tree(node: Any) -> Any:
    """`node` (plain containers) with every string in it, keys included, scrubbed."""
    if isinstance(node, dict):
        return {scrub_tree(k): scrub_tree(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(scrub_tree(v) for v in node)
    return scrub(node) if isinstance(node, str) else node


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
    raw, found = OmegaConf.to_container(config_obj, resolve=False), references(config_obj)
    remember(found)
    return redact(resolved, raw, found), found


class Scrubbed:
    """A text stream whose every write is scrubbed (the `rlrun` command's stdout and stderr): Hydra's lines, the
    console's links, error messages and tracebacks alike."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(scrub(text))
        return len(text)

    def __getattr__(self, name: str):
        if name == "_stream":  # (being unpickled or copied: not set yet)
            raise AttributeError(name)
        return getattr(self._stream, name)


class Filter(logging.Filter):
    """A logging filter that scrubs each record's message (put on the handlers Hydra makes: cli.log)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = scrub(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True


def guard_output() -> None:
    """stdout and stderr scrubbed from now on, and every logging handler there is (idempotent)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, Scrubbed):
            setattr(sys, name, Scrubbed(stream))
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, Filter) for f in handler.filters):
            handler.addFilter(Filter())
