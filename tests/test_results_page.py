"""`eval/RESULTS.md` is what `eval.results_page` makes of `eval/results/`, and its links resolve.

Fast (no engine): the page is regenerated in memory from the JSON and compared section by section.
"""

from __future__ import annotations

import re
from pathlib import Path

from eval import results_page

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_results_page_is_generated_from_its_json() -> None:
    expected = results_page.render(ROOT / results_page.RESULTS)
    actual = (ROOT / results_page.PAGE).read_text()
    stale = results_page.differing_sections(expected, actual)
    assert not stale, f"eval/RESULTS.md differs from its JSON in: {', '.join(stale)}; run `python -m eval.results_page`"


def test_a_changed_number_names_its_section() -> None:
    page = results_page.render(ROOT / results_page.RESULTS)
    sections = results_page.split_sections(page)
    title = next(t for t in sections if t.startswith("Host tier"))
    body = sections[title]
    edited = page.replace(body, body.replace("|", "| 0", 1), 1)
    assert results_page.differing_sections(page, edited) == [title]


def test_every_relative_link_in_the_page_and_the_notes_resolves() -> None:
    files = [ROOT / results_page.PAGE, *sorted((ROOT / "eval/notes").glob("*.md"))]
    assert len(files) > 1, "eval/notes/ has no notes"
    broken = []
    for path in files:
        for target in LINK.findall(path.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                broken.append(f"{path.relative_to(ROOT)}: {target} (only relative links inside the repository)")
                continue
            resolved = (path.parent / target.split("#")[0]).resolve()
            if not resolved.is_relative_to(ROOT) or not resolved.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken, "links that do not resolve to a file in the repository: " + "; ".join(broken)


def test_every_note_is_linked_from_the_page() -> None:
    page = (ROOT / results_page.PAGE).read_text()
    missing = [p.name for p in (ROOT / "eval/notes").glob("*.md") if f"notes/{p.name}" not in page]
    assert not missing, f"notes the page does not link: {missing}"
