"""From a config file (`configs/NAME.py[:ARG]`) or a ConfigDict to a validated `Config`.

The one idea: a config file is run once. `defaults()` is the ConfigDict it starts from (every field
of every section, from the dataclasses), so every field can be overridden with
`--config.SECTION.FIELD=VALUE` whatever the file sets; `check_command_line` reads the file and
checks the overrides for launch.py, which hands the result to ml_collections instead of letting
it read the file a second time.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import re
from typing import Any, NamedTuple

import ml_collections

from dsjax.config.sections import SECTIONS, Config
from dsjax.config.validate import validate
from dsjax.errors import ConfigError, unknown_choice


def defaults() -> ml_collections.ConfigDict:
    """Every section with every field that has a default; config files start here."""
    return ml_collections.ConfigDict({
        **{name: {f.name: f.default for f in dataclasses.fields(cls)
                  if f.default is not dataclasses.MISSING}
           for name, cls in SECTIONS.items()},
        "plan": Config.plan})


def _build_section(name: str, cls: type, raw: Any) -> Any:
    if raw is None:
        raw = {}
    raw = dict(raw.to_dict() if isinstance(raw, ml_collections.ConfigDict) else raw)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(unknown_choice("config key", unknown[0], sorted(fields),
                                         f"{name}.{unknown[0]}"))
    kwargs = {}
    for key, field in fields.items():
        if key not in raw:
            if field.default is dataclasses.MISSING:
                raise ConfigError(f"{name}.{key}: required but missing")
            continue
        kwargs[key] = _coerce(f"{name}.{key}", raw[key], field.type)
    return cls(**kwargs)


def _coerce(path: str, value: Any, type_name: Any) -> Any:
    # Field annotations are strings under `from __future__ import annotations`.
    kind = type_name if isinstance(type_name, str) else getattr(type_name, "__name__", "")
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true/false, got {value!r}")
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if kind == "str":
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    return value


def parse_value(text: str) -> Any:
    """A command-line value as a config field expects it: 4, 0.5, true, onebit_adam."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def from_config_dict(raw: ml_collections.ConfigDict | dict, name: str = "config") -> Config:
    """Turns a ConfigDict (as loaded from `configs/NAME.py`) into a validated `Config`."""
    raw = dict(raw.to_dict() if isinstance(raw, ml_collections.ConfigDict) else raw)
    name = raw.pop("name", name)
    plan = raw.pop("plan", Config.plan)
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise ConfigError(unknown_choice("config section", unknown[0], sorted(SECTIONS),
                                         unknown[0]))
    if "model" not in raw:
        raise ConfigError("model: the config has no model section")
    sections = {key: _build_section(key, cls, raw.get(key)) for key, cls in SECTIONS.items()}
    if not isinstance(plan, str):
        raise ConfigError(f"plan: expected a string, got {plan!r}")
    cfg = Config(name=name, plan=plan, **sections)
    validate(cfg)
    return cfg


def run_name(path_and_arg: str) -> str:
    """The default run name of `configs/NAME.py[:ARG]`: NAME[:ARG]."""
    path, _, arg = path_and_arg.partition(":")
    return os.path.splitext(os.path.basename(path))[0] + (f":{arg}" if arg else "")


def default_workdir(name: str) -> str:
    """runs/<run name> with the name made one safe path component: anything but letters, digits,
    '.', '_' and '-' (a ':' before the variant, a '/' or '..' in an ARG) becomes '_'."""
    safe = re.sub(r"_+", "_", re.sub(r"[^A-Za-z0-9._-]|\.{2,}", "_", name)).strip("._-")
    return os.path.join("runs", safe or "run")


def read_file(path_and_arg: str) -> ml_collections.ConfigDict:
    """Runs `configs/NAME.py[:ARG]`'s `get_config(ARG)`; ConfigError if there is no such file."""
    path, _, arg = path_and_arg.partition(":")
    if not os.path.isfile(path):
        raise ConfigError(f"--config: no such config file {path!r}")
    spec = importlib.util.spec_from_file_location(f"dsjax_config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def load(path_and_arg: str, overrides: dict[str, Any] | None = None) -> Config:
    """Loads `configs/NAME.py[:ARG]` the way `launch.py --config` does; `overrides` maps dotted keys."""
    cfg_dict = read_file(path_and_arg)
    for dotted, value in (overrides or {}).items():
        node = cfg_dict
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return from_config_dict(cfg_dict, name=cfg_dict.get("name", run_name(path_and_arg)))


class CommandLine(NamedTuple):
    """A launch.py command line with its config file read (once)."""
    config: str  # configs/NAME.py[:ARG], as given or the default
    raw: ml_collections.ConfigDict  # its get_config(ARG), before the overrides
    argv: list[str]  # the command line without --config: the flags (and overrides) left to parse


_CONFIG_FLAG = re.compile(r"^--?config(=|$)")  # what ml_collections takes for the file flag
_OVERRIDE = re.compile(r"^--?(no)?config\.")


def check_command_line(argv: list[str], default_path: str) -> CommandLine:
    """Reads `--config` of a launch.py command line (`argv` without the program name) and checks
    every `--config.a.b=v` before ml_collections parses them (its own errors are tracebacks): the
    file exists and loads, and every overridden key exists. Raises ConfigError naming the flag."""
    path_and_arg, rest, overrides = default_path, [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if _CONFIG_FLAG.match(arg) and "=" in arg:
            path_and_arg = arg.split("=", 1)[1]
        elif _CONFIG_FLAG.match(arg) and i + 1 < len(argv):
            path_and_arg, i = argv[i + 1], i + 1
        else:  # (a bare trailing --config stays, for absl to report)
            rest.append(arg)
            if _OVERRIDE.match(arg):
                overrides.append(arg.split("=", 1)[0].split("config.", 1)[1])
        i += 1
    try:
        raw = read_file(path_and_arg)
    except ConfigError:
        raise
    except Exception as e:  # pylint: disable=broad-except  # the user's file; say which
        raise ConfigError(f"--config: {path_and_arg} failed to load: {type(e).__name__}: {e}"
                          ) from None
    for dotted in overrides:
        node = raw
        for part in dotted.split("."):
            keys = node.keys() if isinstance(node, (ml_collections.ConfigDict, dict)) else []
            if part not in keys:
                raise ConfigError(unknown_choice("config key", part, sorted(keys), dotted))
            node = node[part]
    return CommandLine(path_and_arg, raw, rest)
