"""Loading a `RunConfig`: YAML recipe (optionally layered with `base:`) + dotted overrides.

    load_config("configs/tiny_cpu.yaml", ["rollout.max_staleness=2", "fsdp.cpu_offload=false"])

Override values are parsed as YAML scalars (`true`, `2`, `0.5`, `[1, 2]`, `null`); a value
that is not valid YAML is taken as a string, unless it opens a flow collection or a quote
(`[`, `{`, `"`, `'`): then it is refused, naming the override. `trainer.fsdp.X` is accepted
as an alias of `fsdp.X`. Every failure is a `ConfigError` whose message is one line naming
the key (and the override that set it, or the recipe's `FILE:LINE` that did) and, for closed
sets, the valid choices; a list key given one value says to write a list (`[...]`); a
mistyped key gets the nearest keys (`did you mean ...`, difflib) and, when none is near,
the keys valid there. A recipe that is not valid YAML, or that gives one key twice in a
mapping, fails as `FILE:LINE:COLUMN: problem`.

A recipe may leave a key `???` (Hydra's "mandatory"): it loads, but `check_set` refuses it
until a layer or an override gives the key (`configs/grpo_gsm8k.yaml` so leaves `model.path`).
`model.path=tiny` asks for the tiny random model by name (it loads as the empty path).

Keys in `AUTO_KEYS` also take `auto`, which is what a recipe that leaves them out gets. The
loader asks nothing of the machine: `load_config` gives them `RunConfig()`'s values (the CPU
values), and `read_config` also returns which keys were left `auto`, for the launcher to settle
for this machine's GPUs (runtime/memory/auto.py `load_settled`, which `tandem launch` uses): a
settled `RunConfig` holds plain values and `memory.chosen` says what `auto` became and why.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import msgspec
import yaml

from runtime.config import RunConfig
from runtime.errors import ConfigError

ALIASES = {"trainer.fsdp.": "fsdp."}
AUTO = "auto"
AUTO_KEYS = (  # the keys whose value depends on the GPU (runtime/memory/auto.py chooses them)
    "trainer.micro_batch_tokens",
    "rollout.engine.gpu_memory_utilization",
    "rollout.engine.sleep_when_idle",
    "rollout.engine.sleep_level",
    "trainer.offload.optimizer",
    "trainer.offload.params",
    "fsdp.cpu_offload",
)
UNSET = "???"  # a recipe's "you must give this" (as in Hydra/OmegaConf); `tandem launch` refuses it unset
UNSET_HINTS = {
    "model.path": (
        "model.path=/path/to/an/hf-model (or model.path=tiny: the tiny random model, a test "
        "of the plumbing whose reward stays near 0)"
    )
}
TINY = "tiny"  # model.path=tiny: the tiny random model, named (an empty path makes it too)


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:  # type: ignore[assignment]
    """Read `path` (or start from defaults), apply `overrides`, check each key and value, return
    the config; keys left `auto` hold `RunConfig()`'s values."""
    return read_config(path, overrides)[0]


def read_config(path: str | Path | None, overrides: list[str] = ()) -> tuple[RunConfig, list[str]]:  # type: ignore[assignment]
    """`load_config`'s config, and the `AUTO_KEYS` its recipe and overrides leave `auto` (in
    `AUTO_KEYS` order), for `runtime.memory.auto.settle`."""
    data, positions = _read_layers(Path(path)) if path else ({}, {})
    if path and "name" not in data:
        data["name"] = Path(path).stem
    _check_keys(data, RunConfig, "", positions)
    origins: dict[str, str] = {}  # dotted key -> the override that set it, for error messages
    for item in overrides:
        key, value = parse_override(item)
        set_key(data, key, value)
        origins[key] = item
    auto = _take_auto(data)
    cfg = _convert(data, origins, positions)
    if cfg.model.path == TINY:
        cfg.model.path = ""  # asked for by name: the tiny model, as an empty path makes it
    if not cfg.run_dir:
        cfg.run_dir = str(Path("runs") / cfg.name)
    return cfg, auto


def unset_keys(cfg: RunConfig) -> list[str]:
    """The keys the recipe leaves `???` (it cannot run until they are given)."""
    found: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{prefix}{i}.")
        elif node == UNSET:
            found.append(prefix[:-1])

    walk(msgspec.to_builtins(cfg), "")
    return found


def check_set(cfg: RunConfig, recipe: str | Path) -> None:
    """A ConfigError naming the first key `recipe` leaves `???` and what to give it."""
    for key in unset_keys(cfg):
        hint = UNSET_HINTS.get(key, f"{key}=...")
        raise ConfigError(f"{key} is not set: {recipe} leaves it {UNSET} for you to give: add {hint}")


def _take_auto(data: dict[str, Any]) -> list[str]:
    """The `AUTO_KEYS` that `data` sets to `auto` or leaves out, removed from it (so the
    schema's default stands in until the chooser sets them)."""
    auto = []
    for key in AUTO_KEYS:
        *parents, last = key.split(".")
        node: Any = data
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or node.get(last, AUTO) == AUTO:
            auto.append(key)
            if isinstance(node, dict):
                node.pop(last, None)
    return auto


def parse_override(item: str) -> tuple[str, Any]:
    """`a.b=c` → ("a.b", yaml-parsed c), with aliases resolved."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override '{item}' is not key=value")
    for alias, target in ALIASES.items():
        if key.startswith(alias):
            key = target + key[len(alias) :]
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        if raw.lstrip()[:1] in FLOW_OPENERS:  # meant as a list, mapping or quoted string: a typo
            raise ConfigError(f"override '{item}': the value is not valid YAML: {_yaml_problem(exc)}") from None
        value = raw  # a plain string that merely looks like YAML (`a: b`), taken as it is
    return key, value


FLOW_OPENERS = ("[", "{", '"', "'")


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's error as one line: `problem (context at LINE:COL)`, positions 1-based."""
    if not isinstance(exc, yaml.MarkedYAMLError):
        return str(exc).splitlines()[0]
    text = exc.problem or exc.context or "invalid YAML"
    if exc.problem and exc.context:
        where = f" at {exc.context_mark.line + 1}:{exc.context_mark.column + 1}" if exc.context_mark else ""
        text += f" ({exc.context}{where})"
    return text


def set_key(data: dict[str, Any], key: str, value: Any) -> None:
    """Set dotted `key` in the nested dict, after checking every segment is a field."""
    parts = key.split(".")
    typ: Any = RunConfig
    node = data
    for i, part in enumerate(parts):
        fields = _struct_fields(typ)
        if fields is None or part not in fields:
            _unknown(".".join(parts[: i + 1]), typ, full=key)
        if i == len(parts) - 1:
            node[part] = value
            return
        typ = _unwrap(fields[part])
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child


def to_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML (what is written to RUN_DIR/config.yaml)."""
    return yaml.safe_dump(msgspec.to_builtins(cfg), sort_keys=False)


Positions = dict[str, str]  # dotted key -> "FILE:LINE" of the recipe layer that sets it


def _read_layers(path: Path, depth: int = 0) -> tuple[dict[str, Any], Positions]:
    if depth > 8:
        raise ConfigError(f"config '{path}': `base:` chain deeper than 8")
    try:
        text = path.read_text()
        data = yaml.load(text, Loader=_RecipeLoader) or {}  # a SafeLoader (see below)
    except FileNotFoundError:
        raise ConfigError(f"config file '{path}' does not exist") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ConfigError(f"{where}: {_yaml_problem(exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping at the top level")
    positions = _positions(path, text)
    base = data.pop("base", None)
    if base is None:
        return data, positions
    merged, base_positions = _read_layers((path.parent / base).resolve(), depth + 1)
    merged.pop("name", None)
    # A value this layer sets replaces the base's whole subtree there, positions included.
    leaves = [key for key in positions if not isinstance(_lookup(data, key), dict)]
    kept = {k: v for k, v in base_positions.items() if not any(k.startswith(f"{leaf}.") for leaf in leaves)}
    return _deep_merge(merged, data), kept | positions


def _positions(path: Path, text: str) -> Positions:
    """Where each dotted key (list items by index: `placement.1.count`) of a recipe is set."""
    out: Positions = {}

    def walk(node: yaml.Node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            items = [(str(k.value), k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode)]
        elif isinstance(node, yaml.SequenceNode):
            items = [(str(i), v, v) for i, v in enumerate(node.value)]
        else:
            return
        for name, mark_node, child in items:
            out[prefix + name] = f"{path}:{mark_node.start_mark.line + 1}"
            walk(child, f"{prefix}{name}.")

    walk(yaml.compose(text, Loader=yaml.SafeLoader), "")  # parsed once already: it cannot fail here
    return out


def _where(positions: Positions, dotted: str) -> str:
    """`FILE:LINE: ` of `dotted` (or of the nearest enclosing key) in the recipe, or ""."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in positions:
            return f"{positions['.'.join(parts[:n])]}: "
    return ""


class _RecipeLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, except that a key given twice in one mapping is an error
    (SafeLoader keeps the last one in silence: a setting lost without a word)."""


def _refuse_duplicate_keys(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    first: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: overriding merged keys is the point
            continue
        key = loader.construct_object(key_node)
        if not isinstance(key, typing.Hashable):
            continue  # SafeLoader itself refuses an unhashable key, with its position
        if key in first:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key '{key}' (first given on line {first[key]})", key_node.start_mark
            )
        first[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node)


_RecipeLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _refuse_duplicate_keys)


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _check_keys(data: Any, typ: Any, prefix: str, positions: Positions) -> None:
    """Unknown keys anywhere in a YAML tree fail with the key's dotted name and position."""
    fields = _struct_fields(typ)
    if fields is None or not isinstance(data, dict):
        return
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in fields:
            _unknown(path, typ, where=_where(positions, path))
        sub = _unwrap(fields[key])
        if get_origin(sub) is list and isinstance(value, list):
            for i, item in enumerate(value):
                _check_keys(item, _unwrap(get_args(sub)[0]), f"{path}.{i}.", positions)
        else:
            _check_keys(value, sub, f"{path}.", positions)


def _unknown(path: str, parent: Any, full: str = "", where: str = "") -> typing.NoReturn:
    fields = _struct_fields(parent) or {}
    section, _, last = path.rpartition(".")
    name = f"'{full}' ('{path}' is not a key)" if full and full != path else f"'{path}'"
    near = _near_keys(section, last, list(fields))
    if near:
        raise ConfigError(f"{where}unknown config key {name}; did you mean {' or '.join(map(repr, near))}?")
    raise ConfigError(
        f"{where}unknown config key {name}; valid keys under {section or 'the top level'}: {', '.join(fields)}"
    )


def _near_keys(section: str, name: str, fields: list[str]) -> list[str]:
    """What a mistyped key `section.name` may have meant: the nearest key beside it, else
    (outside a list item) a key of that name in another section (`trainer.max_staleness` ->
    `rollout.max_staleness`)."""
    near = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
    if near:
        return [f"{section}.{near[0]}" if section else near[0]]
    if re.fullmatch(r"\d+", section.rpartition(".")[2]):
        return []
    return [k for k in _all_keys() if k.rpartition(".")[2] == name][:3]


def _all_keys() -> list[str]:
    """Every dotted key of the schema, sections included."""
    keys: set[str] = set()
    for doc in describe_keys():
        parts = doc.key.split(".")
        keys.update(".".join(parts[: n + 1]) for n in range(len(parts)))
    return sorted(keys)


def _convert(
    data: dict[str, Any], origins: dict[str, str] | None = None, positions: Positions | None = None
) -> RunConfig:
    try:
        # strict=False: PyYAML reads `1e-3` (no dot) as a string; let float fields take it.
        return msgspec.convert(data, RunConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(str(exc), data, origins or {}, positions or {})) from None


def _explain(message: str, data: dict[str, Any], origins: dict[str, str], positions: Positions) -> str:
    """Rewrite msgspec's message as: [FILE:LINE: ]bad value for 'a.b' (got X) [from override
    'a.b=X']: reason; valid choices (or how to write a list)."""
    m = re.search(r" - at `\$\.?(.*)`$", message)
    path = m.group(1) if m else ""
    reason = message[: m.start()] if m else message
    dotted = re.sub(r"\[(\d+)\]", r".\1", path)
    got = _lookup(data, dotted)
    choices = _choices(dotted)
    source = next((item for key, item in origins.items() if dotted == key or dotted.startswith(f"{key}.")), "")
    text = ("" if source else _where(positions, dotted)) + f"bad value for config key '{dotted}'"
    if got is not _MISSING:
        text += f" (got {got!r})"
    if source:
        text += f" from override '{source}'"
    text += f": {reason}"
    if choices:
        text += f"; valid choices: {', '.join(map(str, choices))}"
    elif reason.startswith("Expected `array`") and got is not _MISSING and not isinstance(got, list | dict):
        listed = f"[{got}]" if yaml.safe_load(f"[{got}]") == [got] else json.dumps([got])
        text += f"; write a list: '{dotted}={listed}'" if source else f"; write a list: {listed}"
    return text


_MISSING = object()


def _lookup(data: Any, dotted: str) -> Any:
    node = data
    for part in dotted.split(".") if dotted else []:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node


def _choices(dotted: str) -> list[Any]:
    typ: Any = RunConfig
    for part in dotted.split(".") if dotted else []:
        if part.isdigit() and get_origin(typ) is list:
            typ = _unwrap(get_args(typ)[0])
            continue
        fields = _struct_fields(typ)
        if not fields or part not in fields:
            return []
        typ = _unwrap(fields[part])
    if get_origin(typ) is Literal:
        return list(get_args(typ))
    if get_origin(typ) in (typing.Union, types.UnionType):
        return [c for a in get_args(typ) if get_origin(a) is Literal for c in get_args(a)]
    return []


def _struct_fields(typ: Any) -> dict[str, Any] | None:
    if isinstance(typ, type) and issubclass(typ, msgspec.Struct):
        hints = typing.get_type_hints(typ, include_extras=True)
        return {name: hints[name] for name in typ.__struct_fields__}
    return None


def _unwrap(typ: Any) -> Any:
    """Strip Annotated and Optional so the walker sees the struct or container type."""
    if get_origin(typ) is typing.Annotated:
        typ = get_args(typ)[0]
    if get_origin(typ) in (typing.Union, types.UnionType):
        args = [a for a in get_args(typ) if a is not type(None)]
        if len(args) == 1:
            return _unwrap(args[0])
    return typ


@dataclasses.dataclass
class KeyDoc:
    key: str
    type: str
    default: str
    description: str


def describe_keys() -> list[KeyDoc]:
    """Every leaf key of the schema with its type, default and description."""
    out: list[KeyDoc] = []
    _describe(RunConfig, RunConfig(), "", out)
    return out


def _describe(typ: Any, default: Any, prefix: str, out: list[KeyDoc]) -> None:
    hints = typing.get_type_hints(typ, include_extras=True)
    for name in typ.__struct_fields__:
        hint = hints[name]
        desc = ""
        if get_origin(hint) is typing.Annotated:
            for meta in get_args(hint)[1:]:
                if isinstance(meta, msgspec.Meta) and meta.description:
                    desc = meta.description
        inner = _unwrap(hint)
        value = getattr(default, name)
        if _struct_fields(inner) is not None and value is not None:
            _describe(inner, value, f"{prefix}{name}.", out)
            continue
        key, type_name, shown = f"{prefix}{name}", _type_name(inner, hint), _fmt(value)
        if key in AUTO_KEYS:  # the default `tandem launch` settles, not the schema's (which stands in for it on CPU)
            type_name, shown = f"{type_name} \\| auto", f"`{AUTO}`"
        out.append(KeyDoc(key, type_name, shown, desc))


def _type_name(inner: Any, hint: Any) -> str:
    if get_origin(inner) is Literal:
        return " \\| ".join(str(a) for a in get_args(inner))
    if isinstance(inner, type):
        return inner.__name__
    if get_origin(inner) in (typing.Union, types.UnionType):  # `bool | Literal["auto"]` reads `bool \| auto`
        return " \\| ".join(_type_name(_unwrap(a), a) for a in get_args(inner))
    text = str(_unwrap(hint) if get_origin(hint) is typing.Annotated else hint)
    return re.sub(r"runtime\.config\.(?:\w+\.)?", "", text).replace("typing.", "").replace("|", "\\|")


def _fmt(value: Any) -> str:
    if isinstance(value, msgspec.Struct):
        return "(see below)"
    return (
        "`"
        + (yaml.safe_dump(msgspec.to_builtins(value), default_flow_style=True).strip().removesuffix("...").strip())
        + "`"
    )


def config_docs() -> str:
    """Markdown reference of every config key (docs/config.md is this text)."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `runtime/config/` by `tandem config-docs`; a test checks it is current.",
        "Set any key in a YAML recipe or on the command line as `key=value` (dotted).",
        "",
        "* `tandem launch RECIPE [key=value ...] --print-config` prints the resolved config (every default",
        "  filled in, every override applied: what `RUN_DIR/config.yaml` will hold) as YAML and exits 0",
        "  without checking, making or starting anything; the output is itself a recipe.",
        "* Override values are YAML (`true`, `2`, `1e-6`, `null`, `[a, b]`). A value that is not valid YAML",
        "  is taken as a plain string (`data.path=a: b: c`), unless it opens a list, a mapping or a quote",
        "  (`[`, `{`, `\"`, `'`): then it is refused, naming the override. A bad value names its key and the",
        "  override that set it: `bad value for config key 'rollout.n' (got '=8') from override 'rollout.n==8'`,",
        "  or the recipe's file and line: `my_run.yaml:7: bad value for config key 'rollout.n' (got 'many') ...`.",
        "  A list key given one value says how to write the list (`reward.functions=[my_reward:score]`), and a",
        "  mistyped key names the one it likely meant: `unknown config key 'rollout.nn'; did you mean 'rollout.n'?`.",
        "* A recipe that is not valid YAML fails before anything starts, in one line naming the file,",
        "  line and column (exit 2): `configs/x.yaml:7:3: mapping values are not allowed here`. So does a",
        "  key given twice in one mapping (PyYAML would keep the last in silence):",
        "  `configs/x.yaml:9:3: duplicate key 'n' (first given on line 4)`; keys beside a `<<:` merge are fine.",
        "* A key whose type reads `... | auto` takes `auto`, its default: the memory plan gives it the fastest value",
        "  that fits the GPUs `tandem launch` finds (or `memory.gpu_gb`), and `memory.chosen` says what",
        "  and why (docs/memory.md). Where no GPU size is known it takes the CPU value its description names;",
        "  `--print-config` shows what each became.",
        "",
        "| key | type | default | description |",
        "| --- | --- | --- | --- |",
    ]
    for doc in describe_keys():
        lines.append(f"| `{doc.key}` | {doc.type} | {doc.default} | {doc.description} |")
    return "\n".join(lines) + "\n"
