"""The built-in model's warm-up is the command `python sft.py --task TASK FLAGS`, cached under a name derived from what
determines it: its flags and an explicit version, not the source text of the functions it calls (editing a comment must
not retrain it)."""

import json
import os

import torch

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


def test_a_changed_flag_or_version_trains_a_new_model(monkeypatch):
    before = {task: folder(task) for task in ("addition", "scratchpad", "multiplication")}
    assert len(set(before.values())) == 3 and all(f.startswith(f"/cache/builtin-{t}-") for t, f in before.items())
    monkeypatch.setitem(models.WARM_UP_FLAGS, "addition", ["--learning-rate", "5e-4"])
    assert folder() != before["addition"]
    monkeypatch.setitem(models.WARM_UP_FLAGS, "addition", [])
    assert folder() == before["addition"]
    monkeypatch.setattr(models, "WARM_UP_VERSION", models.WARM_UP_VERSION + 1)
    assert folder() != before["addition"]


def test_every_warm_up_flag_is_one_sft_py_accepts():
    for task, flags in models.WARM_UP_FLAGS.items():
        args = sft.tyro.cli(sft.Args, args=["--task", task, *flags])
        assert args.task == task and (task == "addition") == (args == sft.Args())


def test_an_empty_cache_runs_the_warm_up_command_once_and_keeps_its_model(monkeypatch, tmp_path):
    """The built-in model is trained by sft.py run as a program (a few steps here), outside this process (under torchrun
    too: the torchrun variables are not passed on), moved into the cache complete, and found there the second time."""
    flags = "--max-steps 2 --check-every 2 --num-check 64 --max-new-tokens 1".split()
    monkeypatch.setitem(models.WARM_UP_FLAGS, "addition", flags)
    monkeypatch.setenv("WORLD_SIZE", "2")  # as in rank 0 of a torchrun job: a warm-up that read these would wait for
    monkeypatch.setenv("RANK", "0")  # a second process (here it fails at once, without MASTER_ADDR)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setattr(models.dist, "true_on_every_rank", lambda value: value)  # this process: alone after all,
    monkeypatch.setattr(models.dist, "barrier", lambda: None)  # with no other rank to agree with or wait for
    cache = str(tmp_path / "cache")
    seed = torch.random.get_rng_state()
    path = models.resolve_model_path("builtin", cache)
    assert path == models.builtin_model_dir(cache) and os.listdir(cache) == [os.path.basename(path)]  # no partial left
    assert json.load(open(os.path.join(path, "warm_up.json")))["sft/steps"] == 2
    assert torch.equal(torch.random.get_rng_state(), seed)  # the caller's random state is left alone
    stamp = os.path.getmtime(os.path.join(path, "config.json"))
    monkeypatch.setattr(models, "warm_up_command", lambda *a: 1 / 0)  # a second warm-up would fail
    assert models.resolve_model_path("builtin", cache) == path and os.path.getmtime(os.path.join(path, "config.json")) == stamp
