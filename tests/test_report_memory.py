"""The report shows each run's peak memory (issue 36 item 1: the step events, the metrics, the report and
``summary.json`` carry it): the page's figures name the highest peak of each kind and its rank, read from
``summary.json``'s ``memory``. Pure: no run."""

from __future__ import annotations

from elastictrain.report import build_view, render_html


def test_the_page_shows_the_runs_peak_memory_and_its_rank() -> None:
    events = [{"event": "run_started", "time": 0.0, "name": "mem", "run_id": "r"}]
    summary = {"wall_s": 1.0, "memory": {"host_mib": 2148.5, "host_rank": 3, "alloc_mib": 70123.0, "alloc_rank": 1,
                                          "reserved_mib": None}}
    page = render_html(build_view(events, summary))
    assert "<b id='fig-host-peak'>2148</b>" in page and "peak host MiB (rank 3)" in page
    assert "<b id='fig-alloc-peak'>70,123</b>" in page and "peak GPU alloc MiB (rank 1)" in page
    assert "fig-reserved-peak" not in page  # a kind no rank reported (a CPU run's device memory) is not drawn
