"""A knob: one setting a user gives, declared once with everything each surface needs: its flag,
help, --help group, type, default, choices and former names.

The engine's knobs are fields of its configs (engine/config.py): `knob(...)` stands as the field's
default, and the field's annotation gives the type (an int, a float, text, a switch, or a `Mode`
enum whose words are the choices). `config_knobs` reads them back, each completed with where it
lands in EngineConfig. From them come `tandem`'s flags (server/flag_sources.py `add_knob_flags`),
and so the YAML keys and TANDEM_ variables; the keywords `LLM(...)` and `EngineConfig.from_flat`
take (the flag's name with underscores); and the parsing of a value as given into the field's
type (`parse_knobs`, when a config is built). The server declares its own knobs as `Knob`s too
(server/cli.py). No torch here.
"""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Iterator, Union

from engine.model_config import ConfigError
from scheduler.modes import Mode

KNOB = "knob"  # the field metadata key a knob is declared under


class Group(str, Enum):
    """The --help sections of the engine's knobs, in the order --help shows them."""

    MEMORY = ("memory budgets: the fit (engine/planning/fit.py) divides them among weights, layer buffers and "
              "both KV pools, and picks the weight and KV formats")
    MEMORY_OVERRIDES = ("memory overrides of the two budgets: each fixes one share itself instead of leaving it "
                        "to the fit")
    MODEL = "model"
    BATCHING = "batching"
    KV_CACHE = "KV cache"
    DEVICE = "device and CPU offloading"
    PARALLEL = "tensor parallelism (Ray)"
    WEIGHTS = "weight streaming (PIPO): where decoder layers live"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Knob:
    """One flag (`flag`, `short`), the keyword with its name (`keyword`), and how a value is
    given: as text converted by `type` (int, float; None: the text itself) among `choices`; as a
    `switch` (--x; or --x/--no-x where the default is on); `repeatable` (--x A --x B); then parsed
    into its field's type by `parse` (a Mode's member, --mlp-slicing's value) where the field is
    not the text itself. `deprecated` names former flags (each also a former keyword),
    `deprecated_keywords` former `LLM(...)` keywords alone: both still work, with a warning.
    `path`: the field it lands in, ("cache", "num_blocks"), or () for a server knob."""

    flag: str
    help: str
    group: str
    default: Any = None
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    short: str | None = None
    deprecated: tuple[str, ...] = ()
    deprecated_keywords: tuple[str, ...] = ()
    switch: bool = False
    repeatable: bool = False
    parse: Callable[[Any], Any] | None = None
    path: tuple[str, ...] = ()

    @property
    def keyword(self) -> str:
        """The flag's name with underscores: --max-num-seqs -> max_num_seqs."""
        return flag_keyword(self.flag)

    @property
    def former_keywords(self) -> tuple[str, ...]:
        return (*map(flag_keyword, self.deprecated), *self.deprecated_keywords)


def flag_keyword(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def knob(flag: str, default: Any, help: str, group: Group, *, choices: tuple[str, ...] | None = None,
         metavar: str | None = None, short: str | None = None, deprecated: tuple[str, ...] = (),
         deprecated_keywords: tuple[str, ...] = (), parse: Callable[[Any], Any] | None = None) -> Any:
    """A config field declared as a knob. Its type, and for a Mode its choices and parsing, come
    from the field's annotation; `choices` for text from a fixed list that is no Mode, `parse` for
    a type that is neither a plain value nor a Mode."""
    declared = Knob(flag, help, str(group), choices=choices, metavar=metavar, short=short, deprecated=deprecated,
                    deprecated_keywords=deprecated_keywords, parse=parse)
    return dataclasses.field(default=default, metadata={KNOB: declared})


def config_knobs(config_type: type) -> tuple[Knob, ...]:
    """Every knob of `config_type` and of its sections (fields of a dataclass type that are no
    knobs themselves), in field order, each with its `path`."""
    return tuple(knob for knob, _ in _walk(config_type, ()) if knob is not None)


def flat_names(config_type: type) -> dict[str, tuple[str, ...]]:
    """Every keyword `from_flat` takes -> the path of its field: a knob's keyword, and the
    field's own name for a field without a flag (NeoKnobs, `show_progress`, ...); TypeError
    where two fields would take the same keyword."""
    names: dict[str, tuple[str, ...]] = {}
    for knob, path in _walk(config_type, ()):
        keyword = knob.keyword if knob is not None else path[-1]
        if keyword in names:
            raise TypeError(f"{'.'.join(path)} and {'.'.join(names[keyword])} both take the keyword {keyword}")
        names[keyword] = path
    return names


def sections(config_type: type) -> dict[str, type]:
    """`config_type`'s fields that are sections: name -> their config type."""
    hints = typing.get_type_hints(config_type)
    return {f.name: hints[f.name] for f in dataclasses.fields(config_type) if _is_section(f, hints[f.name])}


def keyword_of(config_type: type, name: str) -> str:
    """What a message names field `name` of `config_type` by: its knob's keyword (the flag's name
    with underscores, as the user gave it), else the field's own name."""
    declared = dict(_field_knobs(config_type)).get(name)
    return declared.keyword if declared is not None else name


def parse_knobs(config: Any) -> None:
    """For a config being built (its __post_init__): each knob field's value as given (a flag's
    text, or a value of the field's type) in the field's type; ConfigError naming the flag
    where it cannot be."""
    for name, declared in _field_knobs(type(config)):
        value = getattr(config, name)
        if declared.parse is None or (value is None and declared.default is None):
            continue
        try:
            parsed = declared.parse(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{declared.flag} {exc}") from None
        object.__setattr__(config, name, parsed)  # the frozen config is still being built


def _walk(config_type: type, prefix: tuple[str, ...]) -> Iterator[tuple[Knob | None, tuple[str, ...]]]:
    hints = typing.get_type_hints(config_type)
    knobs = dict(_field_knobs(config_type))
    for f in dataclasses.fields(config_type):
        path = (*prefix, f.name)
        if _is_section(f, hints[f.name]):
            yield from _walk(hints[f.name], path)
        elif f.name in knobs:
            yield dataclasses.replace(knobs[f.name], path=path), path
        else:
            yield None, path


def _is_section(f: dataclasses.Field, hint: Any) -> bool:
    return KNOB not in f.metadata and isinstance(hint, type) and dataclasses.is_dataclass(hint)


@functools.cache
def _field_knobs(config_type: type) -> tuple[tuple[str, Knob], ...]:
    """`config_type`'s own knob fields: (name, knob completed from the field)."""
    hints = typing.get_type_hints(config_type)
    return tuple((f.name, _completed(f.metadata[KNOB], f, hints[f.name]))
                 for f in dataclasses.fields(config_type) if KNOB in f.metadata)


def _completed(declared: Knob, f: dataclasses.Field, hint: Any) -> Knob:
    """The declared knob with its default, and its type, choices and parsing from the annotation."""
    value_type = _without_none(hint)
    known = dict(default=f.default, path=(f.name,))
    if isinstance(value_type, type) and issubclass(value_type, Mode):
        return dataclasses.replace(declared, **known, choices=tuple(member.value for member in value_type),
                                   parse=declared.parse or value_type.parse)
    if value_type is bool:
        return dataclasses.replace(declared, **known, switch=True)
    if value_type in (int, float):
        return dataclasses.replace(declared, **known, type=value_type)
    if value_type is not str and declared.parse is None:
        raise TypeError(f"knob {declared.flag}: a field of type {hint} needs a parse function")
    return dataclasses.replace(declared, **known)


def _without_none(hint: Any) -> Any:
    """`X | None` -> X; any other annotation as it is."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        others = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if len(others) == 1:
            return others[0]
    return hint
