"""An offline RULER-style task suite: prompts fitted to an exact token length, RULER's scoring.

    inst = make_instance("niah_single_1", tokenizer, length=2048, seed=0)
    inst.ids            exactly `length` token ids (chat turn and answer prefix included)
    inst.answers        the references; score with string_match_all([prediction], [inst.answers])
    inst.needles        token spans [start, end) of every needle inside inst.ids
    inst.depths         where each needle sits, as a fraction of the haystack (0 = start)
    inst.redraw         0, or the sub-seed of the seed the instance was drawn again from

The tasks follow the generators of NVIDIA's RULER (Hsieh et al., "RULER: What's the Real Context
Size of Your Long-Context Language Models?", COLM 2024, https://arxiv.org/abs/2404.06654): its
templates, needle formats, key and value types, word lists (the `wonderwords` package) and its
string_match_all metric. They are generated here, offline and deterministically from a seed; they
are not RULER's own files. The essay haystack (Paul Graham's essays, a download) is replaced by
natural text that ships with Python (`haystack="pydoc"`, pydoc_data's documentation); RULER's
noise haystack is the default. Generators live in niah.py (passkey and the needle tasks) and
aggregation.py (variable tracking, common and frequent words); fitting.py fits a prompt to its
length.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from .fitting import HAYSTACKS, Ambiguous, chat_frame, check_haystack

MAX_REDRAWS = 100  # an ambiguous draw is rare (1 in 27 of the quick preset's): 100 in a row is a bug


@dataclass
class Instance:
    task: str
    seed: int
    length: int
    ids: list[int]
    answers: list[str]
    max_new_tokens: int
    needles: list[tuple[int, int]] = field(default_factory=list)  # token spans in ids
    depths: list[float] = field(default_factory=list)
    query: str = ""
    haystack: str = "noise"  # noise, pydoc (natural text), needle (distractors), or the task's own
    redraw: int = 0  # the sub-seed of `seed` it was drawn from (0: the seed's own draw; fitting.Ambiguous)

    @property
    def key(self) -> str:
        """The task as results name it: its haystack after an @ where the task has a choice of
        haystacks and the natural-text one was used ("niah_single_1@pydoc")."""
        return f"{self.task}@{self.haystack}" if self.haystack == "pydoc" else self.task


def string_match_all(predictions: list[str], references: list[list[str]]) -> float:
    """RULER's metric: per prediction, the share of its references found in it (case-insensitive),
    averaged over predictions, in percent, rounded to 2 decimals."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} reference lists")
    if not predictions:
        raise ValueError("no predictions to score")
    total = 0.0
    for pred, refs in zip(predictions, references):
        pred = postprocess(pred).lower()
        total += sum(1.0 for r in refs if r.lower() in pred) / len(refs)
    return round(100.0 * total / len(predictions), 2)


def postprocess(prediction: str) -> str:
    """RULER's evaluate.py: control characters become newlines, then the text is stripped."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction).strip()


def _registry() -> dict:
    from . import aggregation, niah

    return {**niah.TASKS, **aggregation.TASKS}


def task_names() -> list[str]:
    return list(_registry())


def haystacks(task: str) -> tuple[str, ...]:
    """The haystacks `task` can be built on: noise and pydoc for the tasks whose RULER haystack is
    noise (passkey, niah_single_1, niah_multivalue, niah_multiquery); the task's own otherwise."""
    return getattr(_registry()[task], "haystacks", ())


def make_instance(task: str, tokenizer, length: int, seed: int, chat: bool = True, haystack: str = "noise") -> Instance:
    """One instance of `task`, exactly `length` tokens. chat=True wraps the task in the model's chat
    template (a user turn, then the assistant turn opened with the answer prefix); passkey always
    uses its benchmark's plain prompt. haystack: "noise" or "pydoc" (natural text), for the tasks
    that offer it (haystacks(task)); other tasks refuse "pydoc". Every seed gives an instance: one
    whose answer came out ambiguous is drawn again from the seed's next sub-seed (inst.redraw)."""
    tasks = _registry()
    if task not in tasks:
        raise ValueError(f"unknown task {task!r}; tasks: {', '.join(tasks)}")
    if not isinstance(length, int) or length < 1:
        raise ValueError(f"length must be a positive int, got {length!r}")
    check_haystack(haystack)
    frame = chat_frame(tokenizer) if chat else ("", "")
    kwargs = {}
    if haystack != "noise":
        if haystack not in haystacks(task):
            raise ValueError(f"task {task!r} has no {haystack} haystack (tasks with one: "
                             f"{', '.join(t for t in tasks if haystack in haystacks(t))})")
        kwargs["haystack"] = haystack
    for redraw in range(MAX_REDRAWS):
        try:
            inst = tasks[task](tokenizer, length, seed, frame, redraw=redraw, **kwargs)
        except Ambiguous:
            continue
        inst.redraw = redraw
        return inst
    raise RuntimeError(f"{task} seed {seed}: {MAX_REDRAWS} draws in a row came out ambiguous")


__all__ = ["HAYSTACKS", "Instance", "haystacks", "make_instance", "postprocess", "string_match_all", "task_names"]
