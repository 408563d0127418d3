"""What the stub ``cohort/_native.pyi`` takes from ``cohort.config``. The stub itself is
checked against the built extension by mypy's stubtest (``scripts/python-stubtest.sh``): the
same names in the module and in each class, the same signatures and defaults."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import cohort

STUB = Path(cohort.__file__).resolve().parent / "_native.pyi"


def test_group_config_is_what_the_stub_and_group_take():
    """``GroupConfig`` is a frozen dataclass (the stub imports it from ``cohort.config``);
    every field has a default but the first two."""
    fields = dataclasses.fields(cohort.GroupConfig)
    required = [f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    assert required == ["job", "coordinator"]
    config = cohort.GroupConfig("j", "http://127.0.0.1:1")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.job = "other"  # type: ignore[misc]
    assert "from cohort.config import GroupConfig" in STUB.read_text()
