"""Fixtures of the end-to-end tests (helpers are in e2e_helpers.py)."""

import pytest


@pytest.fixture(scope="session")
def toy_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("toy_world"))
