"""One declaration per setting: a config dataclass's field carries its command-line flag.

A field declared with `setting(...)` (or, in code that may import nothing of ours, with the same keys in
`metadata={"setting": {...}}`) is a flag: its type comes from the annotation, its default from the field,
or from the environment (`<prefix><FLAG>`, e.g. SPLITFIRE_KV_CACHE_DTYPE), its help from the metadata.

    threads: int | None = setting(None, "torch CPU threads", group="model and engine")
    decode_graphs: str = setting("auto", "...", flag="--enforce-eager", const="off")

`add_flags(parser, Config, env_prefix)` adds one flag per such field; `config_from(Config, args, **given)`
builds the dataclass back from the parsed flags (each flag's value is where argparse puts it, `args.<flag>`;
a switch is true when given and becomes the field's `const`), so nothing copies `args.x` by hand, and the CLI
reference (docs) is generated from the same declarations.

Keys: `help`; `flag` (default `--field-name`); `short` (e.g. `-tp`); `choices`; `const` (a switch: the flag
sets the field to it; bool fields are switches to True by default); `env` (the variable's full name, or
False for none); `parse` (the flag's value -> the field's value); `append` (a list flag repeated one value
at a time; otherwise a list flag takes several values, `nargs` "+" or "*"); `kind` "value" (a list field
given as one string, `parse`d); `metavar`; `group` (the help section); `roles` (only for these values of
`add_flags(role=...)`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any

KEY = "setting"
_SWITCH_TRUE = ("1", "true", "yes", "on")


def setting(default: Any = dataclasses.MISSING, help: str = "", *, factory: Callable[[], Any] | None = None,
            **flag: Any) -> Any:
    """A dataclass field that is also a command-line flag (see the module doc for `flag`'s keys)."""
    meta = {KEY: {"help": help, **flag}}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class Flag:
    """One field's flag, as `add_flags` declares it (the docs' CLI reference reads these too)."""

    field: str
    name: str
    dest: str  # where argparse puts the value: the flag's name (`--no-prefix-cache` -> no_prefix_cache)
    short: str | None
    kind: str  # value | switch | list | append
    type: Callable[[str], Any] | None
    default: Any
    env: str | None
    help: str
    choices: tuple[Any, ...] | None
    const: Any
    metavar: str | None
    group: str | None
    nargs: str = "+"  # list flags: "+" (one or more values) or "*" (the flag alone allowed)


def flags(cls: type, env_prefix: str = "", role: str | None = None) -> list[Flag]:
    """The flags of `cls`'s settings (for `role`, when some are role-specific), in field order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(KEY)
        if meta is None or (role is not None and meta.get("roles") and role not in meta["roles"]):
            continue
        name = meta.get("flag") or "--" + f.name.replace("_", "-")
        env = meta.get("env")
        env = None if env is False else env or env_prefix + name.lstrip("-").replace("-", "_").upper()
        base = _base(hints[f.name])
        if meta.get("kind") == "value":  # (one string parsed into the field's type, e.g. --cpus 0-3)
            kind, const = "value", None
        elif "const" in meta or base is bool:
            kind, const = "switch", meta.get("const", True)
        elif typing.get_origin(base) in (list, dict) or base in (list, dict):
            kind, const = ("append" if meta.get("append") else "list"), None
        else:
            kind, const = "value", None
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        typ = base if kind == "value" and base in (int, float, str) else None
        nargs = meta.get("nargs", "+")
        choices = meta.get("choices")
        out.append(Flag(f.name, name, name.lstrip("-").replace("-", "_"), meta.get("short"), kind, typ, default, env,
                        meta.get("help", ""),
                        tuple(choices) if choices is not None else None, const, meta.get("metavar"), meta.get("group"),
                        nargs))
    return out


def add_flags(parser: argparse.ArgumentParser, cls: type, env_prefix: str = "", role: str | None = None,
              groups: dict[str, Any] | None = None) -> list[Flag]:
    """One flag per setting of `cls` on `parser` (in argument groups by the settings' `group`); returns them."""
    groups = {} if groups is None else groups
    declared = flags(cls, env_prefix, role)
    for fl in declared:
        target: Any = parser
        if fl.group:
            if fl.group not in groups:
                groups[fl.group] = parser.add_argument_group(fl.group)
            target = groups[fl.group]
        names = [fl.name] + ([fl.short] if fl.short else [])
        from_env = os.environ.get(fl.env) if fl.env else None
        kw: dict[str, Any] = {"dest": fl.dest, "help": _help(fl)}
        if fl.metavar or (fl.kind != "switch" and not fl.choices):  # (named for the flag, not the field)
            kw["metavar"] = fl.metavar or fl.name.lstrip("-").replace("-", "_").upper()
        if fl.kind == "switch":  # (given: True; config_from makes it the field's const)
            on = from_env is not None and from_env.strip().lower() in _SWITCH_TRUE
            kw.update(action="store_true", default=on)
        elif fl.kind in ("list", "append"):
            default = [v for v in (from_env or "").replace(",", " ").split() if v] if from_env else []
            kw.update(action="append" if fl.kind == "append" else "extend", default=default)
            if fl.kind == "list":
                kw["nargs"] = fl.nargs
        else:
            kw.update(default=from_env if from_env is not None else fl.default, type=fl.type or str)
            if fl.choices:
                kw["choices"] = fl.choices
        target.add_argument(*names, **kw)
    return declared


def config_from(cls: type, args: argparse.Namespace, for_role: str | None = None, **given: Any) -> Any:
    """`cls` from the parsed flags of its settings (each `parse`d), and `given` for the other fields."""
    values: dict[str, Any] = {}
    for fl in flags(cls, role=for_role):
        if fl.field in given or not hasattr(args, fl.dest):
            continue
        v = getattr(args, fl.dest)
        if fl.kind == "switch":
            v = fl.const if v else fl.default
        elif isinstance(v, list):
            v = list(v)
        parse = _meta(cls, fl.field).get("parse")
        values[fl.field] = parse(v) if parse is not None else v
    return cls(**values, **given)


def _meta(cls: type, name: str) -> dict[str, Any]:
    return next(f.metadata[KEY] for f in dataclasses.fields(cls) if f.name == name)


def _base(hint: Any) -> Any:
    """`X | None` -> X; other hints as they are."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _help(fl: Flag) -> str:
    text = fl.help.replace("%", "%%")
    if fl.env:
        text += f" (env {fl.env})" if text else f"env {fl.env}"
    return text


def env_names(declared: Iterable[Flag]) -> dict[str, str]:
    """Each flag's environment variable (the docs list them)."""
    return {fl.name: fl.env for fl in declared if fl.env}
