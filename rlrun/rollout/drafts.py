"""Where a speculative decode's drafts come from (rollout.speculate=prompt|history; rollout/speculate.py verifies
them): n-gram lookup without a draft model.

A row's draft is what followed the latest earlier occurrence of its last 3 tokens (else 2, else 1) in the text its
group can see: the group's prompt, every completion of the group so far (the row's own included), and, under
`history`, earlier completions of the same prompt in this run (`History`). A draft never changes what is drawn: the
verify pass accepts only the tokens plain decoding would have chosen, so a bad draft costs a wasted position, never
a different token. Plain Python dicts and lists: a few dict operations per row and pass, no tensor work.
"""

from __future__ import annotations

from collections import OrderedDict, deque

NGRAMS = (3, 2, 1)  # the suffix lengths matched, longest first


class Index:
    """n-gram -> (the sequence it occurred in, the position after it): the latest occurrence wins (a sequence is a
    list that may still grow: the draft is read from it when proposed)."""

    def __init__(self) -> None:
        self.table: dict[tuple, tuple[list, int]] = {}

    def add(self, seq: list, end: int, start: int = 0) -> None:
        """The n-grams of `seq` that end before position `end`, from those ending at `start - 1` on: each maps to
        the position after it (an n-gram ending at the last token has nothing after it yet: not added)."""
        for nxt in range(max(start, 1), end):
            for n in NGRAMS:
                if nxt >= n:
                    self.table[tuple(seq[nxt - n:nxt])] = (seq, nxt)

    def draft(self, context: list, k: int) -> list:
        """Up to `k` tokens that followed the longest suffix of `context` seen before ([] where none was)."""
        for n in NGRAMS:
            if len(context) >= n:
                hit = self.table.get(tuple(context[-n:]))
                if hit is not None:
                    seq, nxt = hit
                    if nxt < len(seq):
                        return seq[nxt:nxt + k]
        return []


class History:
    """Earlier completions of each prompt in this run (rollout.speculate=history), in memory, bounded: the latest
    PER_PROMPT completions of each of the PROMPTS most recently seen prompts (older ones forgotten first), keyed by the
    prompt's token ids. A completion is kept up to and including its EOS."""

    PROMPTS = 4096
    PER_PROMPT = 16

    def __init__(self) -> None:
        self.seen: OrderedDict[tuple, deque] = OrderedDict()

    def add(self, prompt: tuple, completion: list) -> None:
        kept = self.seen.pop(prompt, None) or deque(maxlen=self.PER_PROMPT)
        kept.append(list(completion))
        self.seen[prompt] = kept  # the most recent last
        while len(self.seen) > self.PROMPTS:
            self.seen.popitem(last=False)

    def of(self, prompt: tuple) -> list[list]:
        return list(self.seen.get(prompt, ()))

    def __len__(self) -> int:
        return sum(len(v) for v in self.seen.values())


class Drafter:
    """The drafts of one rollout: each row's context (its prompt, then its completion so far) and one `Index` per
    group of rows sharing a prompt (`groups[i]`: row i's group), holding the prompt, the group's completions as they
    grow and, with a `History`, the prompt's earlier completions (each as prompt + completion, so that a row that has
    drafted nothing yet is drafted the earlier completion's start)."""

    def __init__(self, prompts: list[list[int]], groups: list[int], history: History | None = None):
        self.contexts = [list(p) for p in prompts]
        self.starts = [len(p) for p in prompts]  # where each row's completion starts in its context
        self.groups = groups
        self.indexes: dict[int, Index] = {}
        for row, group in enumerate(groups):
            if group in self.indexes:
                continue
            index = self.indexes[group] = Index()
            prompt = prompts[row]
            index.add(prompt, len(prompt))
            for earlier in history.of(tuple(prompt)) if history is not None else ():
                seq = [*prompt, *earlier]
                index.add(seq, len(seq), start=len(prompt))  # from the n-grams that end at the prompt's end on
        self.proposed = self.accepted = 0  # drafted tokens verified, and those accepted

    def propose(self, rows: list[int], k: int) -> list[list]:
        """Each row's draft of up to `k` tokens (possibly none)."""
        return [self.indexes[self.groups[r]].draft(self.contexts[r], k) for r in rows]

    def extend(self, row: int, tokens: list[int]) -> None:
        """Row `row` accepted `tokens`: its context grows and the n-grams they complete enter its group's index."""
        context = self.contexts[row]
        end = len(context)
        context.extend(tokens)
        self.indexes[self.groups[row]].add(context, len(context), start=end)

    def completion(self, row: int) -> list[int]:
        return self.contexts[row][self.starts[row]:]
