"""The guard that no run of the suite drops BASE_JOB's ``workers.reuse`` / ``workers.standby`` by replacing
the whole section (tests/base_workers.py, applied to every ``Trainer.fit`` by tests/conftest.py). Two files
did (last stop: test_pp_recovery, test_prepared_data), and their runs started every worker fresh."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from elastictrain import Trainer, build_config
from elastictrain.config import ConfigError
from tests.base_workers import dropped_workers_settings, guarded_fit
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


def test_every_fit_of_the_suite_is_guarded_and_a_run_of_a_replaced_section_fails_its_test() -> None:
    assert getattr(Trainer.fit, "base_workers_guard", False)  # conftest's fixture is on for every test
    replaced = SimpleNamespace(config=build_config({**job(), "workers": {"min": 2, "max": 2}}))
    merged = SimpleNamespace(config=build_config(job(workers={"min": 2, "max": 2})))
    ran: list = []
    fit = guarded_fit(lambda trainer: ran.append(trainer) or "result")  # a run that returned
    with pytest.raises(pytest.fail.Exception, match=r"does not set workers.reuse and workers.standby"):
        fit(replaced)
    assert fit(merged) == "result" and ran == [replaced, merged]

    def refused(trainer):  # a preflight's error, which a test may expect: left as it is
        raise ConfigError("train.steps=0: must be > 0")

    with pytest.raises(ConfigError, match="train.steps=0"):
        guarded_fit(refused)(replaced)
