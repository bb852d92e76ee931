"""Checks that `loadtest/results/` stays a set of results a reader can find (run by `make lint`):

- every file under it is named in its index, `loadtest/results/README.md` (a folder named with a trailing `/`
  covers the files inside it), and everything the index names exists;
- every file is cited by a docs page or a benchmark module: by its path from the repository root, or by its name
  in a text that also names its folder's path;
- no results file, docs page or top-level document carries a path of the machine it was written on.

    python -m loadtest.check_results
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "loadtest" / "results"
INDEX = RESULTS / "README.md"

_NAMED = re.compile(r"`([^`\s]+)`")
# An absolute path under a home, scratch or checkout directory: where a file was written, not what it means.
_MACHINE_PATH = re.compile(r"(?<![\w.$~/-])/(?:work|root|home|tmp|Users|var/tmp)/[\w.-]")
_TEXT = {".txt", ".json", ".md", ".svg", ".csv", ".log"}


def results_files() -> list[Path]:
    return sorted(p for p in RESULTS.rglob("*") if p.is_file() and p != INDEX)


def index_entries(text: str) -> set[str]:
    """Paths the index's tables name in their first column, relative to loadtest/results/."""
    out = set()
    for line in text.splitlines():
        if line.startswith("| `"):
            out |= {n.removeprefix("loadtest/results/") for n in _NAMED.findall(line.split(" | ")[0])}
    return out


def citing_texts() -> dict[Path, str]:
    files = [*ROOT.glob("docs/**/*.md"), *ROOT.glob("loadtest/*.py"), *ROOT.glob("loadtest/*.sh")]
    return {p: p.read_text(encoding="utf-8") for p in files if p.resolve() != Path(__file__).resolve()}


def cited(rel: str, texts: dict[Path, str]) -> bool:
    """A text names the file's path; or its name and its folder's path; or a folder below <topic>/<machine>/
    holding it (a set of files cited together, such as flame graphs)."""
    full = f"loadtest/results/{rel}"
    folder, name = full.rsplit("/", 1)
    parts = rel.split("/")
    sets = [f"loadtest/results/{'/'.join(parts[:i])}" for i in range(3, len(parts))]
    for text in texts.values():
        if full in text or (name in text and folder + "/" in text):
            return True
        if any(re.search(re.escape(s) + r"(?![\w.-])", text) for s in sets):
            return True
    return False


def machine_paths(paths: list[Path]) -> list[str]:
    found = []
    for p in paths:
        if p.suffix not in _TEXT:
            continue
        for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            m = _MACHINE_PATH.search(line)
            if m:
                found.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    return found


def problems() -> list[str]:
    out: list[str] = []
    if not INDEX.exists():
        return [f"{INDEX.relative_to(ROOT)} is missing: every results file must be listed there"]
    entries = index_entries(INDEX.read_text(encoding="utf-8"))
    files = results_files()
    rels = [p.relative_to(RESULTS).as_posix() for p in files]
    for rel in rels:
        if rel not in entries and not any(e.endswith("/") and rel.startswith(e) for e in entries):
            out.append(f"loadtest/results/{rel}: not listed in loadtest/results/README.md")
    for e in sorted(entries):
        if not (RESULTS / e).exists():
            out.append(f"loadtest/results/README.md names {e}, which does not exist")
    texts = citing_texts()
    for rel in rels:
        if not cited(rel, texts):
            out.append(f"loadtest/results/{rel}: cited by no docs page or benchmark (name it where its numbers are used, "
                       "or delete it: history stays in git)")
    documents = [*files, INDEX, *ROOT.glob("docs/**/*.md"), ROOT / "README.md", ROOT / "CONTRIBUTING.md",
                 ROOT / "CHANGELOG.md"]
    out += [f"a machine's path: {hit}" for hit in machine_paths([p for p in documents if p.exists()])]
    return out


def main() -> int:
    found = problems()
    for line in found:
        print(line, file=sys.stderr)
    if found:
        print(f"check_results: {len(found)} problem(s)", file=sys.stderr)
        return 1
    print(f"check_results: {len(results_files())} results files, all indexed and cited; no machine paths")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
