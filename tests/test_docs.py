"""The docs can be trusted: the generated reference pages hold every flag, metric and chart value (each checked
against a source other than the generator's own walk: `--help` output, the metric names in the code, values.yaml
read by PyYAML), the site builds with --strict, and every link in README.md resolves."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _gen():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen():
    return _gen()


def _help_flags(argv: list[str]) -> set[str]:
    out = subprocess.run([sys.executable, "-m", "splitfire_cli", *argv, "--help"], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "COLUMNS": "200"}, timeout=120)
    assert out.returncode == 0, out.stderr
    flags: set[str] = set()
    for line in out.stdout.splitlines():  # argparse lists each option as "  -x N, --xx N   help..."
        m = re.match(r"^ {2}(-\S.*?)(?: {2,}|$)", line)
        if m:
            flags |= set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", m.group(1)))
    return flags - {"-h", "--help"}


def test_every_flag_of_every_command_is_on_the_cli_page(gen):
    page = gen.cli_page()
    sections = dict(re.findall(r"^## `splitfire ([^`]+)`\n(.*?)(?=^## |\Z)", page, re.S | re.M))
    assert {"prefill", "decode", "serve", "router", "up", "generate", "plan", "compress", "planner run"} <= set(sections)
    for command, text in sections.items():
        flags = _help_flags(command.split())
        missing = sorted(f for f in flags if f"`{f}`" not in text)
        assert not missing, f"splitfire {command}: flags in --help but not on the CLI page: {missing}"


def test_every_metric_in_the_code_is_on_the_metrics_page(gen):
    page = gen.metrics_page()
    sources = [*ROOT.glob("router/**/*.py"), *ROOT.glob("worker/**/*.py"), *ROOT.glob("prefill_worker/*.py"),
               *ROOT.glob("decode_worker/*.py"), *ROOT.glob("planner/*.py")]
    names = set()
    for path in sources:
        names |= set(re.findall(r"[\"'](splitfire_(?:router|worker|tenant)_[a-z_]+)[\"']", path.read_text()))
    assert len(names) > 40
    missing = sorted(n for n in names if f"`{n}`" not in page and f"`{n.removesuffix('_total')}`" not in page)
    assert not missing, f"metrics in the code but not on the metrics page: {missing}"
    for row in gen.metric_rows():
        assert row[4].strip(), f"{row[1]} has no help text"


def _flatten(tree: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in tree.items():
        keys.append(prefix + key)
        if isinstance(value, dict) and value:
            keys += _flatten(value, prefix + key + ".")
    return keys


def test_every_chart_value_is_on_the_values_page(gen):
    values = yaml.safe_load((ROOT / "helm" / "splitfire" / "values.yaml").read_text())
    page = gen.values_page()
    keys = _flatten(values)
    assert len(keys) > 100
    missing = [k for k in keys if f"| `{k}` |" not in page]
    assert not missing, f"values.yaml keys not on the chart-values page: {missing}"
    undocumented = [k for k, _, _, doc in gen.value_rows() if not doc and k.count(".") == 0]
    assert not undocumented, f"top-level values without a comment in values.yaml: {undocumented}"


def test_readme_is_short_and_every_link_resolves():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        if link.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = link.partition("#")
        target = (ROOT / path) if path else ROOT / "README.md"
        assert target.exists(), f"README links to {link}, which does not exist"
        if anchor and target.suffix == ".md":
            slugs = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-")
                     for h in re.findall(r"^#+ (.+)$", target.read_text(), re.M)}
            assert anchor in slugs, f"README links to {link}: no such heading"


def test_the_site_builds_strict(tmp_path):
    mkdocs = Path(sys.executable).parent / "mkdocs"
    if not mkdocs.exists():
        pytest.skip("mkdocs is not installed (make setup installs the docs extra)")
    env = {**os.environ, "DISABLE_MKDOCS_2_WARNING": "true", "NO_MKDOCS_2_WARNING": "1"}
    out = subprocess.run([str(mkdocs), "build", "--strict", "--quiet", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    for page in ("index.html", "reference/cli/index.html", "reference/metrics/index.html",
                 "reference/chart-values/index.html", "changelog/index.html", "contributing/index.html"):
        assert (tmp_path / "site" / page).exists(), page
    assert "--kv-cache-dtype" in (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
