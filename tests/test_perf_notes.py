"""Measured figures live in dated notes under docs/perf/ (STYLE.md habit 9): every note is named and titled
by its date, docs/design.md links every note, and every docs/perf path the code or the docs cite exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PERF = ROOT / "docs" / "perf"
CITE = re.compile(r"docs/perf/([\w.-]+\.md)")


def test_each_perf_note_is_named_and_titled_by_its_date() -> None:
    notes = sorted(PERF.glob("*.md"))
    assert notes
    for note in notes:
        date = re.match(r"(\d{4}-\d{2}-\d{2})-[a-z0-9-]+\.md$", note.name)
        assert date, f"{note.name}: name it YYYY-MM-DD-what.md"
        assert note.read_text().startswith(f"# {date.group(1)}"), f"{note.name}: title starts with its date"


def test_design_links_every_perf_note() -> None:
    design = (ROOT / "docs" / "design.md").read_text()
    missing = [n.name for n in PERF.glob("*.md") if f"(perf/{n.name})" not in design]
    assert not missing, f"docs/design.md does not link {missing}"


def test_every_cited_perf_note_exists() -> None:
    sources = [*ROOT.glob("elastictrain/**/*.py"), *ROOT.glob("benchmarks/*.py"), *ROOT.glob("docs/**/*.md"),
               ROOT / "README.md"]
    cited = {(p.relative_to(ROOT).as_posix(), name) for p in sources for name in CITE.findall(p.read_text())}
    assert len(cited) > 10  # the code does point at its figures
    dangling = sorted((src, name) for src, name in cited if not (PERF / name).is_file())
    assert not dangling, f"cited but not in docs/perf: {dangling}"
