"""The built-in model's warm-up is cached under a name derived from what determines it: its settings and an explicit
version, not the source text of the functions it calls (editing a comment must not retrain it)."""

import dataclasses

import common
import sft
from plumbing import models


def folder(task: str = "addition") -> str:
    return models.builtin_model_dir.__wrapped__("/cache", task)  # without the once-per-process memo


def test_editing_the_source_of_what_the_warm_up_calls_keeps_the_cached_model(monkeypatch):
    before = folder()
    for module, name in ((common, "generate"), (common, "evaluate"), (sft, "warm_up"), (sft, "build_tiny_model")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, **kw: _f(*a, **kw))  # other source text, same effect
    assert folder() == before


def test_a_changed_setting_or_version_trains_a_new_model(monkeypatch):
    before = {task: folder(task) for task in ("addition", "scratchpad", "multiplication")}
    assert len(set(before.values())) == 3 and all(f.startswith(f"/cache/builtin-{t}-") for t, f in before.items())
    settings = sft.warm_up_args
    monkeypatch.setattr(sft, "warm_up_args", lambda task: dataclasses.replace(settings(task), learning_rate=5e-4))
    assert folder() != before["addition"]
    monkeypatch.setattr(sft, "warm_up_args", settings)
    monkeypatch.setattr(sft, "WARM_UP_VERSION", sft.WARM_UP_VERSION + 1)
    assert folder() != before["addition"]
