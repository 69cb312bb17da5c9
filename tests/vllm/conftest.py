"""Fixtures for the connector's tests: a tiny model folder and P/D instances that are closed."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from harness import Instance, model_dir  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture
def make_instance(tiny_model):
    made = []

    def make(name, kv_role, read_mode=False, **options):
        instance = Instance(name, kv_role, read_mode, tiny_model, **options)
        made.append(instance)
        return instance

    yield make
    for instance in made:
        instance.close()
