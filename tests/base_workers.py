"""The suite's guard for BASE_JOB's ``workers`` settings (tests/conftest.py): a spec that replaces the whole
``workers`` section (``{**spec, "workers": {"min": 2, "max": 2}}``) silently drops the suite's
``reuse: true`` / ``standby: false``, and its run starts every worker fresh and a standby beside them
(seconds of CPU each), which nothing in the test asks for. Every run the suite trains in its own process
must state both keys (``job(workers={...})`` merges them from BASE_JOB); a test whose promise is about a
default states it (``"reuse": False``). The test fails once its run returned (a run that raises, e.g. a
preflight's ConfigError a test expects, is left alone)."""

from __future__ import annotations

from typing import Any, Callable

import pytest

KEPT = ("reuse", "standby")


def dropped_workers_settings(config: Any) -> str | None:
    """The one-line complaint for a run whose config does not state ``workers.reuse`` and
    ``workers.standby``; None when it does (or runs on GPUs, where neither applies)."""
    workers = config.workers
    if workers.use_gpu:
        return None
    missing = [f"workers.{key}" for key in KEPT if key not in workers.model_fields_set]
    if not missing:
        return None
    return (f"this run's config does not set {' and '.join(missing)} (BASE_JOB's workers section was replaced "
            f"whole: the run starts fresh processes and a standby nobody asked for); merge the section "
            f"(job(workers={{...}}) or {{**spec['workers'], ...}}), or set {' and '.join(missing)} explicitly "
            f"when the default is the promise")


def guarded_fit(fit: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``Trainer.fit`` that fails the test after a run whose config drops the settings
    (:func:`dropped_workers_settings`). A ``fit`` that raises is left alone: a test that expects its
    preflight's ConfigError (raised in ``fit``, before anything starts) keeps its own error."""

    def checked(trainer: Any) -> Any:
        problem = dropped_workers_settings(trainer.config)
        result = fit(trainer)
        if problem is not None:
            pytest.fail(problem, pytrace=False)
        return result

    checked.base_workers_guard = True  # type: ignore[attr-defined]  # tests/test_base_workers.py checks it is on
    return checked
