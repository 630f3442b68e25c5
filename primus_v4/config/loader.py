"""Strict YAML -> `RunConfig`: unknown keys and wrong types are errors naming key, file and line.

Order of resolution: the YAML file, then `--set a.b=c` overrides, then `${ENV}` /
`${ENV:default}` references in string values. A `--set` value, and a file value that is exactly
one reference, is typed by the field it sets (`Raw`): a string field takes the text literally
(`--set data.path=run #2/c.json` is that path, not `run` and a YAML comment), any other field
parses it as YAML (`--set train.steps=5` is an int). The resolved config round-trips:
`load_config_text(dump_yaml(cfg)) == cfg`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml

from primus_v4.config.schema import SECTIONS, RunConfig
from primus_v4.durable import write_durable
from primus_v4.errors import ConfigError
from primus_v4.log import get_logger

log = get_logger(__name__)

# Run configs ship inside the package (package data), so a wheel install has them too.
RUNS_DIR = Path(__file__).resolve().parents[1] / "configs" / "runs"
DEFAULT_CONFIG = RUNS_DIR / "tiny_cpu_thd.yaml"
SHIPPED = "shipped config "  # how messages name a file of RUNS_DIR
_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|[-+]?(inf|nan)")
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::([^}]*))?\}")


class _Where:
    """Remembers where each dotted key came from (`file:line` or `--set`), for error messages."""

    def __init__(self, default: str) -> None:
        self.default = default
        self.by_key: dict[str, str] = {}

    def __call__(self, key: str) -> str:
        while key:
            if key in self.by_key:
                return self.by_key[key]
            key = key.rpartition(".")[0]
        return self.default


def _record_lines(node: yaml.Node, prefix: str, source: str, where: _Where) -> None:
    if not isinstance(node, yaml.MappingNode):
        return
    for key_node, value_node in node.value:
        key = f"{prefix}{key_node.value}"
        where.by_key[key] = f"{source}:{key_node.start_mark.line + 1}"
        _record_lines(value_node, f"{key}.", source, where)


def yaml_problem(exc: yaml.YAMLError, source: str) -> str:
    """A YAML error as one line that names the file (not PyYAML's "<unicode string>"), its line
    and column, and the problem."""
    mark = getattr(exc, "problem_mark", None)
    where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    return f"{where}: not valid YAML: {problem}" + (f" ({context})" if context else "")


def _parse_yaml(text: str, source: str, where: _Where) -> dict[str, Any]:
    try:
        tree = yaml.safe_load(text)
        node = yaml.compose(text)
    except yaml.YAMLError as exc:
        raise ConfigError(yaml_problem(exc, source)) from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{source}: top level must be a mapping of sections, got {type(tree)}")
    if node is not None:
        _record_lines(node, "", source, where)
    return tree


class _PlacedError(ConfigError):
    """A message that already names where the value came from."""


_NULLS = ("", "~", "null", "Null", "NULL")


@dataclasses.dataclass(kw_only=True, frozen=True)
class Raw:
    """A value given as text (`--set`, or a whole `${ENV}` reference): the field's type decides
    how it is read, so a path keeps its ` #`, `: ` and quotes-free spaces."""

    text: str
    source: str

    def parsed(self) -> Any:
        try:
            return _plain(yaml.safe_load(self.text)) if self.text.strip() else None
        except yaml.YAMLError as exc:
            raise _PlacedError(yaml_problem(exc, self.source)) from None

    def typed(self, hint: Any) -> Any:
        """The text as `hint` reads it: literal for a string field (null still means None
        where None is allowed; quoted or [list] / {mapping} text is YAML), else YAML."""
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        options = typing.get_args(hint) if union else (hint,)
        text = self.text.strip()
        if type(None) in options and text in _NULLS:
            return None
        if str in options and text and text[0] not in "[{'\"":
            return text
        return self.parsed()


def _plain(value: Any) -> Any:
    """`value` with every Raw inside read as YAML (a field of type Any, a dict or a list)."""
    if isinstance(value, Raw):
        return value.parsed()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _split_override(item: str) -> tuple[list[str], Any]:
    key, sep, raw = item.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) < 2 or not all(parts):
        raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. train.steps=5")
    return parts, Raw(text=raw, source=f"--set {item!r} (value)")


def apply_overrides(tree: dict[str, Any], overrides: Iterable[str], where: _Where) -> None:
    """`a.b=c` sets tree[a][b] = yaml(c); deeper keys (model.overrides.x=1) create mappings."""
    for item in overrides:
        parts, value = _split_override(item)
        node = tree
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if isinstance(child, Raw):  # an earlier --set gave the whole section
                child = node[part] = child.parsed()
            if not isinstance(child, dict):
                path = ".".join(parts[: depth + 1])
                raise ConfigError(f"--set {item!r}: {path} is a value, not a section")
            node = child
        node[parts[-1]] = value
        for depth in range(1, len(parts) + 1):
            where.by_key.setdefault(".".join(parts[:depth]), f"--set {item}")
        where.by_key[".".join(parts)] = f"--set {item}"


def _expand_env(value: str, key: str, where: _Where) -> Any:
    def lookup(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is None:
            raise ConfigError(
                f"{where(key)}: {key}: environment variable {name} is not set and has no "
                f"default; export it or write ${{{name}:default}}"
            )
        return default

    whole = _ENV_REF.fullmatch(value)
    expanded = _ENV_REF.sub(lookup, value)
    if whole is None:
        return expanded
    # a value that is exactly one reference is typed by its field, as a --set value is
    return Raw(text=expanded, source=f"{where(key)}: {key}: {value} = {expanded!r}")


def _interpolate_raw(value: Raw, where: _Where, key: str) -> Raw:
    if "${" not in value.text:
        return value
    expanded = _expand_env(value.text, key, where)
    text = expanded.text if isinstance(expanded, Raw) else expanded
    return dataclasses.replace(value, text=text)


def interpolate(tree: Any, where: _Where, prefix: str = "") -> Any:
    """Expand `${ENV}` / `${ENV:default}` in every string of the tree."""
    if isinstance(tree, dict):
        return {k: interpolate(v, where, f"{prefix}{k}.") for k, v in tree.items()}
    if isinstance(tree, list):
        return [interpolate(v, where, prefix) for v in tree]
    if isinstance(tree, str) and "${" in tree:
        return _expand_env(tree, prefix.rstrip("."), where)
    if isinstance(tree, Raw):
        return _interpolate_raw(tree, where, prefix.rstrip("."))
    return tree


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _check_finite(value: Any, key: str) -> None:
    """inf/nan are never meaningful config values (a lr of inf trains to nan at step 1)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}: must be a finite number, got {value!r}")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_finite(v, f"{key}.{k}")
    if isinstance(value, list):
        for i, v in enumerate(value):
            _check_finite(v, f"{key}[{i}]")


def coerce(value: Any, hint: Any, key: str) -> Any:
    """Check `value` against a field's type hint (ints widen to floats, floats must be finite).
    Raises ConfigError."""
    value = _coerce(value, hint, key)
    _check_finite(value, key)
    return value


def _coerce(value: Any, hint: Any, key: str) -> Any:
    if isinstance(value, Raw):
        value = value.typed(hint)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in typing.get_args(hint):
            if option is type(None) and value is None:
                return None
            try:
                return _coerce(value, option, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{key}: expected {_type_name(hint)}, got {value!r}")
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        if isinstance(value, hint):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping of {hint.__name__} keys, got {value!r}")
        return _build(hint, value, key)
    if origin is Literal:
        choices = typing.get_args(hint)
        if isinstance(value, bool) and ("on" if value else "off") in choices:
            return "on" if value else "off"  # YAML 1.1 reads a bare off / on as a boolean
        if value not in choices:
            raise ConfigError(f"{key}: must be one of {list(choices)}, got {value!r}")
        return value
    if origin in (dict, list):
        if not isinstance(value, origin):
            raise ConfigError(f"{key}: expected a {origin.__name__}, got {value!r}")
        return _plain(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
        return float(value)  # YAML 1.1 reads `1e-3` (no dot) as a string
    if hint is Any:
        return _plain(value)
    if isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
        return value
    raise ConfigError(f"{key}: expected {_type_name(hint)}, got {type(value).__name__} {value!r}")


def _unknown(key: str, known: Iterable[str], where: _Where, what: str) -> ConfigError:
    name = key.rpartition(".")[2]
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known: {sorted(known)}"
    return ConfigError(f"{where(key)}: unknown {what} {key!r}{hint}")


def _build_section(name: str, values: Any, where: _Where) -> Any:
    cls = SECTIONS[name]
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where(name)}: section {name!r} must be a mapping, got {values!r}")
    try:
        return _build(cls, values, name)
    except _PlacedError:
        raise
    except ConfigError as exc:  # the message starts with the innermost key at fault
        key = str(exc).partition(":")[0]
        at = key if key.startswith(name) else name
        raise ConfigError(f"{where(at)}: {exc}") from None


def _build(cls: type, values: Mapping[str, Any], prefix: str) -> Any:
    """The dataclass `cls` from a mapping: unknown keys and wrong types are errors naming the
    dotted key; a field that is itself a dataclass (model.lora) is built the same way."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        dotted = f"{prefix}.{key}"
        if key not in known:
            raise _unknown(dotted, known, lambda k: k, "key")
        kwargs[key] = coerce(value, hints[key], dotted)
    return cls(**kwargs)


def _chosen(key: str, where: _Where) -> bool:
    """Whether the user set `key` (a --set or their own file), not a shipped config or default."""
    source = where.by_key.get(key)
    return source is not None and not source.startswith(SHIPPED)


def _fit_warmup(sections: dict[str, Any], where: _Where) -> None:
    """A warmup the user did not choose (the shipped config's, or the default) longer than the
    steps they asked for is shortened to them, with a warning, instead of refusing the run."""
    train = sections.get("train")
    if train is None or train.steps is None or train.warmup_steps <= train.steps:
        return
    if _chosen("train.warmup_steps", where) or not _chosen("train.steps", where):
        return
    log.warning(
        "train.warmup_steps=%d (%s) exceeds train.steps=%d: warming up over %d steps; set "
        "train.warmup_steps to choose", train.warmup_steps,
        where.by_key.get("train.warmup_steps", "the default"), train.steps, train.steps,
    )  # fmt: skip
    sections["train"] = dataclasses.replace(train, warmup_steps=train.steps)


def build_config(tree: Mapping[str, Any], where: _Where | None = None) -> RunConfig:
    """Strictly turn a mapping of sections into a validated RunConfig."""
    where = where or _Where("<dict>")
    sections = {}
    for name, values in tree.items():
        if name not in SECTIONS:
            raise _unknown(name, SECTIONS, where, "section")
        sections[name] = _build_section(name, values or {}, where)
    _fit_warmup(sections, where)
    try:
        return RunConfig(**sections)
    except ConfigError as exc:
        key = str(exc).partition(":")[0]
        raise ConfigError(f"{where(key)}: {exc}") from None


def load_config_text(
    text: str, *, source: str = "<text>", overrides: Iterable[str] = ()
) -> RunConfig:
    where = _Where(source)
    tree = _parse_yaml(text, source, where)
    apply_overrides(tree, overrides, where)
    return build_config(interpolate(tree, where), where)


def bundled_run_configs() -> list[str]:
    """Names of the run configs shipped with the package (`--config NAME`)."""
    return sorted(p.stem for p in RUNS_DIR.glob("*.yaml"))


def config_path(path_or_name: str | Path) -> Path:
    """A run config file: an existing path, else a shipped config by name (`tiny_cpu_thd`, with
    or without .yaml, or as `configs/runs/<name>.yaml` as the repository lays it out)."""
    path = Path(path_or_name).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        raise ConfigError(f"config {path} is a directory; pass a YAML file")
    bundled = RUNS_DIR / (path.stem + ".yaml")
    if (
        path.suffix in ("", ".yaml")
        and bundled.is_file()
        and (path.parent == Path() or path.parent.parts[-2:] == ("configs", "runs"))
    ):
        return bundled
    raise ConfigError(
        f"config file {path} does not exist; pass the path of your YAML file or one of the "
        f"shipped run configs by name: {bundled_run_configs()}"
    )


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> RunConfig:
    """Load a run config (a file path or a shipped config name; default: the embedded
    tiny_cpu_thd.yaml) plus `--set` items."""
    path = config_path(path) if path is not None else DEFAULT_CONFIG
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {path}: not UTF-8 text (byte {exc.start}); pass a YAML file"
        ) from None
    # A shipped config is named as such, not by its path inside site-packages.
    shipped = path.resolve().parent == RUNS_DIR
    source = f"{SHIPPED}{path.stem}" if shipped else str(path)
    return load_config_text(text, source=source, overrides=overrides)


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    """Plain nested dict (sections in declaration order); the inverse of `build_config`."""
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: RunConfig) -> str:
    header = "# Resolved primus-v4 run config (file + --set + ${ENV}); loads back unchanged.\n"
    return header + yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def write_resolved(cfg: RunConfig, directory: str | Path | None = None) -> Path:
    """Write `<output.dir>/config.yaml` atomically; returns its path."""
    out = Path(directory if directory is not None else cfg.output.dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.yaml"
    write_durable(path, dump_yaml(cfg))  # never through a link planted at either name
    return path
