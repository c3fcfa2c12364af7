"""The docs a user reads: a short front door, links that resolve, results that link to their
re-creating command, and no development history."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
HISTORY = re.compile(r"session [0-9]+", re.IGNORECASE)
TREES = ("README.md", "docs", "rollout_ext", "patches", "bench", "examples", "tests")


def slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+ (.*)$", path.read_text(), re.M)}


def broken_links(path: Path, text: str) -> list[str]:
    broken = []
    for link in re.findall(r"\]\(([^)\s]+)\)", text):
        if link.startswith(("http://", "https://")):
            continue
        target, _, anchor = link.partition("#")
        resolved = (path.parent / target).resolve() if target else path
        if not resolved.exists():
            broken.append(f"{link} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{link} (no such heading)")
    return broken


def test_no_file_speaks_of_development_sessions():
    assert HISTORY.search("measured in Session " + "12")  # control (split, so this file stays clean)
    found = []
    for tree in TREES:
        root = ROOT / tree
        for path in [root] if root.is_file() else root.rglob("*"):
            if path.is_file() and path.suffix in (".md", ".py", ".sh", ".yaml", ".toml", ".txt"):
                found += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in HISTORY.finditer(path.read_text())]
    assert not found, found


def test_every_link_in_the_docs_resolves():
    readme = ROOT / "README.md"
    assert broken_links(readme, "[x](docs/results.md#no-such-row) [y](docs/nope.md)") == [
        "docs/results.md#no-such-row (no such heading)", "docs/nope.md (no such file)"]  # control
    broken = {str(p.relative_to(ROOT)): broken_links(p, p.read_text()) for p in DOCS}
    assert not any(broken.values()), broken


def test_readme_is_a_front_door_whose_results_each_link_to_their_command():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 200
    results = text.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    claims = re.split(r"\n(?=- \*\*)", results.strip())[1:]
    assert len(claims) >= 6
    for claim in claims:
        if re.search(r"\d", claim):
            assert re.search(r"\]\(docs/results\.md#[\w-]+\)", claim), claim
    # Each linked row gives the command that re-creates it.
    sections = (ROOT / "docs" / "results.md").read_text().split("\n## ")
    for anchor in set(re.findall(r"docs/results\.md#([\w-]+)", results)):
        section = next(s for s in sections if slug(s.splitlines()[0]) == anchor)
        assert "```bash" in section, anchor
