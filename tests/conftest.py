"""Fixtures shared by several test files."""

import pytest

import sft


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny model after a few warm-up steps (the real warm-up runs far longer; this only has to run)."""
    path = str(tmp_path_factory.mktemp("warm") / "model")
    sft.warm_up(sft.Args(output_dir=path, max_steps=30, check_every=30, target_accuracy=2.0, num_check=100, device="cpu"))
    return path
