"""The endless, resumable prompt order the recipes draw batches from."""

from __future__ import annotations

import random


class PromptStream:
    """Endless epochs over `examples`, reshuffled each epoch from `seed`; its position can be saved (resume)."""

    def __init__(self, examples: list[dict], seed: int):
        self.examples, self.rng, self.pos = examples, random.Random(seed), 0
        self.order: list[int] = []  # this epoch's order of the examples' indices

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.pos >= len(self.order):
            self.order = list(range(len(self.examples)))
            self.rng.shuffle(self.order)
            self.pos = 0
        self.pos += 1
        return self.examples[self.order[self.pos - 1]]

    def state_dict(self) -> dict:
        return {"rng": self.rng.getstate(), "order": list(self.order), "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.rng.setstate(state["rng"])
        self.order, self.pos = list(state["order"]), state["pos"]


prompt_stream = PromptStream
