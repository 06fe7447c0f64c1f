"""Shared fixtures: one real embedded engine per session (loading it costs a second)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

from clef_guard import LocalDecisionModel


@pytest.fixture(scope="session")
def engine() -> LocalDecisionModel:
    """The embedded default engine, with its prefix cache on."""
    return LocalDecisionModel()


@pytest.fixture(scope="session")
def uncached_engine() -> LocalDecisionModel:
    """The same backbone with the prefix cache off, to compare against."""
    return LocalDecisionModel(prefix_cache_size=0)


@pytest.fixture(scope="session")
def wide_engine() -> LocalDecisionModel:
    """The backbone alone reading choices of more than 16 options wide, as training does; no prefix cache."""
    return LocalDecisionModel(default_head=False, wide_choice_options=16, prefix_cache_size=0, encoder=None)
