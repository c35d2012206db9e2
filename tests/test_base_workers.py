"""The guard that no run of the suite drops BASE_JOB's ``workers.reuse`` / ``workers.standby`` by replacing
the whole section (tests/base_workers.py, applied to every ``Trainer.fit`` by tests/conftest.py). Two files
did (last stop: test_pp_recovery, test_prepared_data), and their runs started every worker fresh."""

from __future__ import annotations

import pytest

from elastictrain import Trainer, build_config
from tests.base_workers import dropped_workers_settings
from tests.conftest import job


def test_a_replaced_workers_section_is_named_and_a_merged_one_passes() -> None:
    replaced = build_config({**job(), "workers": {"min": 2, "max": 2}})
    problem = dropped_workers_settings(replaced)
    assert problem is not None and "workers.reuse and workers.standby" in problem and "job(workers=" in problem
    only_reuse = build_config({**job(), "workers": {"min": 2, "max": 2, "reuse": False}})
    assert "does not set workers.standby " in dropped_workers_settings(only_reuse)
    assert dropped_workers_settings(build_config(job(workers={"min": 2, "max": 2}))) is None  # merged
    stated = {"min": 2, "max": 2, "reuse": False, "standby": True}  # the defaults, on purpose
    assert dropped_workers_settings(build_config({**job(), "workers": stated})) is None
    gpu = build_config({**job(), "workers": {"use_gpu": True}})  # neither applies on GPUs
    assert dropped_workers_settings(gpu) is None


def test_a_run_of_a_replaced_section_fails_its_test_before_anything_starts(tmp_path) -> None:
    spec = {**job(), "workers": {"min": 2, "max": 2}}
    with pytest.raises(pytest.fail.Exception, match=r"does not set workers.reuse and workers.standby"):
        Trainer(build_config(spec), run_dir=tmp_path / "run", console=None).fit()
    assert not (tmp_path / "run").exists()  # refused before the run started (no Ray, no run directory)
