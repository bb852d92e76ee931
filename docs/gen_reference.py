"""The reference pages generated from the code at build time (mkdocs-gen-files runs this), so they cannot
drift: every flag of every `splitfire` command (from the argparse definitions, which are generated in turn
from the config dataclasses' fields), every Prometheus series of the router and the workers (from their
registries), and every value of the Helm chart (from values.yaml's documented keys).

`tests/test_docs.py` calls the same functions and checks that nothing is missing.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _html_safe(text: str) -> str:
    """Free text for a Markdown table: a `<name>` placeholder is text, not an HTML tag."""
    return text.replace("<", "&lt;").replace(">", "&gt;")


# -- CLI --------------------------------------------------------------------------------------------

def commands() -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(command line, what it does, parser) of every `splitfire` command, nested ones included, in the parser's
    order."""
    from splitfire_cli import build_parser

    out: list[tuple[str, str, argparse.ArgumentParser]] = []

    def walk(prefix: str, summary: str, parser: argparse.ArgumentParser) -> None:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        own = [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
        if prefix != "splitfire" and (own or not subs):
            out.append((prefix, summary, parser))
        for sub in subs:
            helps = {c.dest: c.help or "" for c in sub._choices_actions}
            for name, child in sub.choices.items():
                walk(f"{prefix} {name}", helps.get(name, ""), child)

    walk("splitfire", "", build_parser())
    return out


def flag_rows(parser: argparse.ArgumentParser) -> list[tuple[str, str, str, str]]:
    """(flags, default, choices, help) of each option of `parser` (help's own flag aside)."""
    rows = []
    for a in parser._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        names = ", ".join(f"`{s}`" for s in a.option_strings) or f"`{a.dest}` (positional)"
        default = "" if a.default in (None, argparse.SUPPRESS, False, [], {}) else f"`{a.default}`"
        choices = " / ".join(f"`{c}`" for c in a.choices) if a.choices else ""
        text = _html_safe((a.help or "").replace("%%", "%").replace("|", "\\|").replace("\n", " "))
        rows.append((names, default, choices, text))
    return rows


def cli_page() -> str:
    lines = ["# Command-line reference", "",
             "Every flag of every `splitfire` command, generated from the code when this site is built. Engine "
             "and worker flags can also be set from the environment (`SPLITFIRE_<FLAG>`, the router's "
             "`SPLITFIRE_ROUTER_<FLAG>`), as each row says.", ""]
    for line, summary, parser in commands():
        what = (parser.description or summary).split("\n")[0]
        lines += [f"## `{line}`", "", what[:1].upper() + what[1:] + ("" if what.endswith(".") else "."), "",
                  "| flag | default | choices | what it does |", "| --- | --- | --- | --- |"]
        lines += [f"| {n} | {d} | {c} | {h} |" for n, d, c, h in flag_rows(parser)]
        lines.append("")
    return "\n".join(lines)


# -- metrics ----------------------------------------------------------------------------------------

def metric_rows() -> list[tuple[str, str, str, str, str]]:
    """(process, series, type, labels, meaning) of every series the router and the workers export."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from router.core.endpoints import EndpointRegistry
    from router.core.metrics import RouterMetrics
    from router.placement.kv_events import KVIndexCollector
    from worker.metrics import WorkerMetrics

    rows: list[tuple[str, str, str, str, str]] = []
    router = RouterMetrics(EndpointRegistry())
    # (the exact prefix index's series exist with --redis-url and KV events: listed here either way)
    router.registry.register(KVIndexCollector(SimpleNamespace(views={}, events=0, resyncs=0, gaps=0)))  # type: ignore[arg-type]
    registries = [("router", router.registry), ("worker", WorkerMetrics("decode").registry)]
    for process, registry in registries:
        assert isinstance(registry, CollectorRegistry)
        for family in registry.collect():
            labels = sorted({k for s in family.samples for k in s.labels if k not in ("le", "quantile")})
            declared = _declared_labels(registry, family.name) or list(getattr(family, "_labelnames", ()))
            rows.append((process, family.name, family.type, ", ".join(f"`{x}`" for x in declared or labels),
                         family.documentation.replace("|", "\\|")))
    return rows


def _declared_labels(registry, name: str) -> list[str]:
    """A metric's label names as declared (the family has no samples until a child exists)."""
    for collector in list(registry._collector_to_names):
        if getattr(collector, "_name", None) in (name, name.removesuffix("_total")):
            return list(getattr(collector, "_labelnames", ()))
    return []


def metrics_page() -> str:
    lines = ["# Metrics reference", "",
             "Every Prometheus series the router (`/metrics` on its port) and each worker (`/metrics` on its metrics "
             "port, the gRPC port + 1000 by default) export, generated from their registries when this site is "
             "built. Counters carry Prometheus's `_total` suffix when scraped; histograms `_bucket`, `_sum`, "
             "`_count`.", "", "| process | series | type | labels | meaning |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {p} | `{n}` | {t} | {lab} | {doc} |" for p, n, t, lab, doc in metric_rows()]
    return "\n".join(lines) + "\n"


# -- chart values -----------------------------------------------------------------------------------

_KEY = re.compile(r"^(\s*)([A-Za-z_][A-Za-z0-9_]*):(.*)$")


def _value_comments(path: Path) -> dict[str, str]:
    """Each block-style key's dotted path -> the comment lines above it (and any comment after its value):
    values.yaml documents every key that way."""
    docs: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    comment: list[str] = []
    for raw in path.read_text().splitlines():
        line = raw.rstrip()
        stripped = line.strip()
        if stripped.startswith("#"):
            if line.startswith("#  -") or line.startswith("#   "):  # (a commented-out example)
                continue
            comment.append(stripped.lstrip("#").strip().removeprefix("-- "))
            continue
        m = _KEY.match(line) if stripped else None
        if m is None:  # (a blank line, a list item or a continuation: part of the value above)
            comment = []
            continue
        indent, key, rest = len(m.group(1)), m.group(2), m.group(3).strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key))
        inline = rest.partition(" #")[2]
        docs[".".join(k for _, k in stack)] = " ".join(comment + ([inline.strip()] if inline else []))
        comment = []
    return docs


def _schema_text(node: dict | None) -> str:
    """What values.schema.json accepts at one key, in a few words: its type(s), enum, bounds, pattern."""
    if not node:
        return ""
    if "anyOf" in node or "oneOf" in node:
        return " or ".join(t for t in (_schema_text(n) for n in node.get("anyOf", node.get("oneOf", []))) if t)
    words = []
    kind = node.get("type")
    if kind:
        words.append(" or ".join(kind) if isinstance(kind, list) else kind)
    if "enum" in node:
        words.append("one of " + ", ".join(f"`{v}`" for v in node["enum"]))
    if "minimum" in node or "maximum" in node:
        words.append(f"{node.get('minimum', '')}..{node.get('maximum', '')}")
    if "pattern" in node:
        words.append("matching `" + node["pattern"].replace("|", "\\|") + "`")
    return " ".join(words)


def _schema_at(schema: dict, dotted: str) -> dict | None:
    node: dict | None = schema
    for key in dotted.split("."):
        if node is None:
            return None
        props = node.get("properties", {})
        extra = node.get("additionalProperties")
        node = props.get(key) if key in props else (extra if isinstance(extra, dict) else None)
    return node


def value_rows(path: Path = ROOT / "helm" / "splitfire" / "values.yaml") -> list[tuple[str, str, str, str]]:
    """(dotted key, default, what the schema accepts, meaning) of every key in values.yaml, nested ones included:
    the keys and defaults as PyYAML reads them, the schema from values.schema.json beside it, the meanings from the
    file's comments."""
    import json

    import yaml

    docs = _value_comments(path)
    schema = json.loads((path.parent / "values.schema.json").read_text())
    rows: list[tuple[str, str, str, str]] = []

    def walk(tree: dict, prefix: str) -> None:
        for key, value in tree.items():
            dotted = prefix + str(key)
            doc = docs[dotted] if dotted in docs else f"part of `{prefix.rstrip('.')}`"
            if isinstance(value, dict) and value:
                rows.append((dotted, "", _schema_text(_schema_at(schema, dotted)), doc.replace("|", "\\|")))
                walk(value, dotted + ".")
            else:
                shown = json.dumps(value, default=str) if not isinstance(value, str) else value
                rows.append((dotted, shown.replace("|", "\\|"), _schema_text(_schema_at(schema, dotted)),
                             doc.replace("|", "\\|")))

    walk(yaml.safe_load(path.read_text()), "")
    return rows


def values_page() -> str:
    lines = ["# Helm chart values", "",
             "Every key of `helm/splitfire/values.yaml` with its default and what it means, generated from the file "
             "when this site is built, with what `values.schema.json` accepts for it (checked at `helm install`). A "
             "key with no default shown holds the keys below it.", "",
             "| key | default | accepts | meaning |", "| --- | --- | --- | --- |"]
    lines += [f"| `{k}` | {f'`{v}`' if v else ''} | {t} | {_html_safe(d)} |" for k, v, t, d in value_rows()]
    return "\n".join(lines) + "\n"


def top_level_page(name: str) -> str:
    """A top-level document (CONTRIBUTING.md, CHANGELOG.md) as a site page, its links into docs/ made relative to
    the site."""
    return re.sub(r"\]\(docs/", "](", (ROOT / name).read_text())


def main() -> None:
    import mkdocs_gen_files

    for name, page in (("cli.md", cli_page), ("metrics.md", metrics_page), ("chart-values.md", values_page)):
        with mkdocs_gen_files.open(f"reference/{name}", "w") as f:
            f.write(page())
    for source, target in (("CONTRIBUTING.md", "contributing.md"), ("CHANGELOG.md", "changelog.md")):
        with mkdocs_gen_files.open(target, "w") as f:
            f.write(top_level_page(source))
    # The benchmark plots, so pages can show them: loadtest/results/<topic>/<machine>/x.png at results/...
    results = ROOT / "loadtest" / "results"
    for png in sorted(results.rglob("*.png")):
        with mkdocs_gen_files.open(f"results/{png.relative_to(results).as_posix()}", "wb") as f:
            f.write(png.read_bytes())


if __name__ in ("__main__", "<run_path>"):
    main()
