"""Prompts as text or as chat `messages`, turned into the exact text the tokenizer is fed."""

from __future__ import annotations

from collections.abc import Mapping

from .base import TaskError, short

CHOICES = ("auto", True, False)


def template_setting(value):
    """task.chat_template as 'auto', True or False ('true' / 'false' strings accepted, e.g. from a CLI)."""
    if isinstance(value, str) and value.lower() in ("auto", "true", "false"):
        return {"auto": "auto", "true": True, "false": False}[value.lower()]
    if isinstance(value, bool):
        return value
    raise TaskError(f"task.chat_template={value!r}; choose auto (the tokenizer's template when it has one), true "
                    "or false.")


def format_rows(rows: list[dict], fmt, where: str) -> list[dict]:
    """`rows` with their prompts formatted by `fmt`; without a template (the default of arith and jsonl) these
    rows stay the very same objects."""
    if not fmt.use:
        return rows
    return [dict(r, prompt=fmt(r["prompt"], f"{where} row {i}", "prompt")) for i, r in enumerate(rows)]


def has_template(tokenizer) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


class Formatter:
    """value (text or [{role, content}]) -> prompt text. With a template, text becomes one user message; the
    system prompt goes first unless the row's messages already start with a system message (the row wins)."""

    def __init__(self, tokenizer, setting, add_generation_prompt: bool = True, system_prompt: str | None = None):
        setting = template_setting(setting)
        if setting is True and not has_template(tokenizer):
            raise TaskError("task.chat_template=true but the tokenizer has no chat template; set "
                            "task.chat_template=false (prompts fed as plain text) or use a tokenizer that has one "
                            "(tokenizer_config.json 'chat_template', or tokenizer.chat_template = '...').")
        self.tokenizer = tokenizer
        self.use = has_template(tokenizer) if setting == "auto" else setting
        if system_prompt is not None and not self.use:
            raise TaskError("task.system_prompt needs a chat template, and none is applied (task.chat_template="
                            f"{setting}, the tokenizer {'has none' if not has_template(tokenizer) else 'has one'}); "
                            "put the instruction in the prompt text instead, or apply a template.")
        self.generation, self.system = add_generation_prompt, system_prompt

    def __call__(self, value, where: str, key: str) -> str:
        if isinstance(value, str):
            if not value.strip():
                raise TaskError(f"{where}: the prompt ({key}) is empty.")
            if not self.use:
                return value
            return self._apply([{"role": "user", "content": value}], where)
        if isinstance(value, list):
            messages = _messages(value, where, key)
            if not self.use:
                raise TaskError(f"{where}: the prompt ({key}) is a list of messages, but no chat template is "
                                "applied (task.chat_template=false, or auto and the tokenizer has none); use a "
                                "tokenizer with a chat template, or text prompts.")
            return self._apply(messages, where)
        raise TaskError(f"{where}: the prompt ({key}) is {short(value)} ({type(value).__name__}); need text or a "
                        "list of {role, content} messages.")

    def _apply(self, messages: list[dict], where: str) -> str:
        if self.system is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system}, *messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=self.generation)
        except Exception as e:  # a template's own raise_exception(), or a Jinja error
            raise TaskError(f"{where}: the tokenizer's chat template failed ({type(e).__name__}: {e}).") from e
        if not isinstance(text, str):
            raise TaskError(f"{where}: the chat template gave {type(text).__name__}, not text.")
        return text


def _messages(value: list, where: str, key: str) -> list[dict]:
    if not value:
        raise TaskError(f"{where}: the prompt ({key}) is an empty list of messages.")
    for j, m in enumerate(value):
        if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise TaskError(f"{where}: message {j} of the prompt ({key}) is {short(m)}; each message needs string "
                            "'role' and 'content'.")
    return [dict(m) for m in value]
