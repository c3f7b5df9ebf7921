"""The flags of `tandem`'s commands, made from knob declarations (`add_knob_flags`, engine/knobs.py),
and their values from outside the command line: `tandem serve --config FILE.yaml` and TANDEM_<FLAG>
environment variables.

A file's keys are the flags' long names without the dashes (`max-num-seqs`; `max_num_seqs` is
accepted too, and an alias such as `num-blocks` or the negation `no-x` of a --x/--no-x switch names
its flag as on the command line). An environment variable is TANDEM_ and the flag's first long
name in capitals with underscores (TANDEM_MAX_NUM_SEQS). Each value is checked by its flag's own
type and choices and becomes the parser's default, so the sources stack: the command line over
the environment over the file over the built-in defaults. A key or variable that names no flag is
refused with its name and the closest flag's. A flag's former name (`add_deprecated_flag`) still
works everywhere, hidden from --help, and logs a warning naming the flag that replaced it.
"""
from __future__ import annotations

import argparse
import difflib
import logging
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import yaml

from engine.knobs import Knob

CONFIG_ENV = "TANDEM_CONFIG"  # the file when --config is not given
ENV_PREFIX = "TANDEM_"
# TANDEM_* variables that are not flags: comma-separated keys added to --api-key's
# (server/cli.py), the profile cache (engine/profiling/cache.py), the config file itself.
OTHER_VARIABLES = frozenset({"TANDEM_API_KEY", "TANDEM_CACHE_DIR", CONFIG_ENV})
NOT_SETTABLE = frozenset({"help", "config"})  # flag dests no file or variable sets
_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
_FALSE_WORDS = frozenset({"0", "false", "no", "off"})
log = logging.getLogger(__name__)


class FlagSourceError(ValueError):
    """A config file or environment variable that cannot set a flag; the message names the key."""


class RepeatableFlag(argparse.Action):
    """A flag given once per value (`--api-key A --api-key B`). Values on the command line replace
    a list that came from the file or the environment instead of extending it."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest, None)
        kept = [] if current is None or current is self.default else list(current)
        setattr(namespace, self.dest, [*kept, values])


class DeprecatedFlag(argparse.Action):
    """A flag's former name, hidden from --help: it sets the same value as the flag that replaced
    it and logs a warning naming that flag (from a file or a variable: `_warn_if_deprecated`)."""

    def __init__(self, option_strings, dest, replaced_by: str, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.replaced_by = replaced_by

    def __call__(self, parser, namespace, values, option_string=None):
        log.warning("%s is deprecated: use %s", option_string, self.replaced_by)
        setattr(namespace, self.dest, values)


def add_knob_flags(parser: argparse.ArgumentParser, knobs: Iterable[Knob], group_order: Sequence[str] = ()) -> None:
    """One flag per knob, under its --help group, with its former names as deprecated flags; the
    groups in `group_order` first, the others in the order their first knob comes."""
    knobs = list(knobs)
    titles = dict.fromkeys([*map(str, group_order), *(knob.group for knob in knobs)])
    used = {knob.group for knob in knobs}
    groups = {title: parser.add_argument_group(title) for title in titles if title in used}
    for knob in knobs:
        group = groups[knob.group]
        flag = group.add_argument(knob.flag, *([knob.short] if knob.short else []), dest=knob.keyword,
                                  default=knob.default, help=knob.help.replace("%", "%%"), **_how_given(knob))
        for former in knob.deprecated:
            add_deprecated_flag(group, former, flag)


def _how_given(knob: Knob) -> dict[str, Any]:
    """The add_argument arguments for how the knob's value is given."""
    if knob.switch:  # --x, or --x/--no-x where it is on by default
        return {"action": argparse.BooleanOptionalAction if knob.default else "store_true"}
    if knob.repeatable:
        return {"action": RepeatableFlag, "type": knob.type, "metavar": knob.metavar}
    return {"type": knob.type, "choices": knob.choices, "metavar": knob.metavar}


def add_deprecated_flag(group, old_name: str, flag: argparse.Action) -> None:
    """Keep `old_name` working as a deprecated name of `flag` (what add_argument returned) on the
    command line, as a file key and as a TANDEM_ variable."""
    group.add_argument(old_name, action=DeprecatedFlag, replaced_by=flag.option_strings[0], dest=flag.dest,
                       type=flag.type, choices=flag.choices, metavar=flag.metavar, default=argparse.SUPPRESS,
                       help=argparse.SUPPRESS)


def _warn_if_deprecated(action: argparse.Action, name: str, spelling: Callable[[str], str]) -> None:
    """For a DeprecatedFlag's file key or variable `name`: the warning, with its replacement as
    `spelling` writes the replacing flag (--cpu-attention -> 'cpu-attention', TANDEM_CPU_ATTENTION)."""
    if isinstance(action, DeprecatedFlag):
        log.warning("%s is deprecated: use %s", name, spelling(action.replaced_by))


def layered_defaults(parser: argparse.ArgumentParser, argv: list[str], environ: Mapping[str, str]) -> dict[str, Any]:
    """Defaults for `parser`'s flags: the file that --config (or TANDEM_CONFIG) in `argv` names,
    with the environment's TANDEM_<FLAG> variables over it."""
    path = config_path(argv, environ)
    from_file = file_defaults(parser, path) if path else {}
    return {**from_file, **environment_defaults(parser, environ)}


def config_path(argv: list[str], environ: Mapping[str, str]) -> str | None:
    """--config's value in `argv`, else $TANDEM_CONFIG, else None."""
    finder = argparse.ArgumentParser(prog="tandem serve", add_help=False)
    finder.add_argument("--config")
    known, _ = finder.parse_known_args(argv)
    return known.config or environ.get(CONFIG_ENV) or None


def read_config_file(path: str) -> dict:
    """The file's mapping of flag names to values ({} for an empty file)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise FlagSourceError(f"--config {path}: {exc.strerror or exc}") from None
    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise FlagSourceError(f"--config {path}: not valid YAML: {exc}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise FlagSourceError(f"--config {path}: expected a mapping of flag names to values, "
                              f"got {type(values).__name__}")
    return values


def file_defaults(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """The flag values the file sets, by dest; `null` leaves a flag at its default."""
    flags = settable_flags(parser)
    defaults: dict[str, Any] = {}
    key_of_dest: dict[str, str] = {}
    for key, value in read_config_file(path).items():
        name = str(key).replace("_", "-")
        if name not in flags:
            raise FlagSourceError(f"{path}: unknown key {key!r}: no flag --{name}{_closest(name, flags)}")
        action, negated = flags[name]
        if action.dest in key_of_dest:
            raise FlagSourceError(f"{path}: {key_of_dest[action.dest]!r} and {key!r} set the same flag")
        key_of_dest[action.dest] = key
        _warn_if_deprecated(action, f"{path}: key {key!r}", lambda flag: repr(flag.lstrip("-")))
        if value is not None:
            defaults[action.dest] = _file_value(action, negated, value, f"{path}: {key}")
    return defaults


def environment_defaults(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> dict[str, Any]:
    """The flag values TANDEM_<FLAG> variables set, by dest."""
    names = {env_name(action): action for action in _settable_actions(parser)
             if env_name(action) not in OTHER_VARIABLES}
    unknown = sorted(name for name in environ if name.startswith(ENV_PREFIX) and name not in names
                     and name not in OTHER_VARIABLES)
    if unknown:
        raise FlagSourceError(f"unknown environment variable {unknown[0]}: no flag "
                              f"--{_flag_name(unknown[0])}{_closest(unknown[0], names)}")
    defaults: dict[str, Any] = {}
    name_of_dest: dict[str, str] = {}
    for name, action in names.items():
        if name in environ:
            if action.dest in name_of_dest:
                raise FlagSourceError(f"{name_of_dest[action.dest]} and {name} set the same flag")
            name_of_dest[action.dest] = name
            _warn_if_deprecated(action, name, lambda flag: ENV_PREFIX + _dest_words(flag))
            defaults[action.dest] = _text_value(action, environ[name], name)
    return defaults


def env_name(action: argparse.Action) -> str:
    """TANDEM_ and the flag's first long name: --max-num-seqs -> TANDEM_MAX_NUM_SEQS."""
    return ENV_PREFIX + _dest_words(action.option_strings[0])


def _dest_words(option: str) -> str:
    return option.lstrip("-").upper().replace("-", "_")


def settable_flags(parser: argparse.ArgumentParser) -> dict[str, tuple[argparse.Action, bool]]:
    """Each key a file may use -> (its flag, whether the key is the flag's negation)."""
    keys = {}
    for action in _settable_actions(parser):
        for option in action.option_strings:
            if option.startswith("--"):
                negated = isinstance(action, argparse.BooleanOptionalAction) and option.startswith("--no-")
                keys[option[2:]] = (action, negated)
    return keys


def _settable_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest not in NOT_SETTABLE]


def _is_switch(action: argparse.Action) -> bool:
    """A flag that takes no value (store_true, --x/--no-x)."""
    return action.nargs == 0


def _file_value(action: argparse.Action, negated: bool, value: Any, where: str) -> Any:
    if _is_switch(action):
        if not isinstance(value, bool):
            raise FlagSourceError(f"{where}: expected true or false, got {value!r}")
        return value != negated
    if isinstance(action, RepeatableFlag):
        items = value if isinstance(value, list) else [value]
        return [_typed(action, _scalar_text(action, item, where), where) for item in items]
    return _typed(action, _scalar_text(action, value, where), where)


def _scalar_text(action: argparse.Action, value: Any, where: str) -> str:
    """A YAML scalar as the text the command line would carry."""
    if isinstance(value, bool):
        # YAML 1.1 reads on/off/yes/no as booleans: `cpu-attention: off` means the choice "off"
        if action.choices is not None and {"on", "off"} <= set(action.choices):
            return "on" if value else "off"
        raise FlagSourceError(f"{where}: expected {_expected(action)}, got {str(value).lower()} "
                              f"(quote it if you mean the word)")
    if isinstance(value, (list, dict)):
        raise FlagSourceError(f"{where}: expected one value ({_expected(action)}), got {value!r}")
    return str(value)


def _text_value(action: argparse.Action, text: str, where: str) -> Any:
    """An environment variable's value for its flag."""
    if _is_switch(action):
        word = text.strip().lower()
        if word not in _TRUE_WORDS | _FALSE_WORDS:
            raise FlagSourceError(f"{where}: expected true or false, got {text!r}")
        return word in _TRUE_WORDS
    if isinstance(action, RepeatableFlag):
        return [_typed(action, item.strip(), where) for item in text.split(",") if item.strip()]
    return _typed(action, text, where)


def _typed(action: argparse.Action, text: str, where: str) -> Any:
    """`text` through the flag's own type and choices, as argparse would take it."""
    try:
        value = action.type(text) if action.type is not None else text
    except (TypeError, ValueError):
        raise FlagSourceError(f"{where}: expected {_expected(action)}, got {text!r}") from None
    if action.choices is not None and value not in action.choices:
        raise FlagSourceError(f"{where}: must be one of {', '.join(map(str, action.choices))}, got {value!r}")
    return value


def _expected(action: argparse.Action) -> str:
    if action.choices is not None:
        return "one of " + ", ".join(map(str, action.choices))
    return {int: "an integer", float: "a number"}.get(action.type, "a string")


def _flag_name(variable: str) -> str:
    return variable[len(ENV_PREFIX):].lower().replace("_", "-")


def _closest(name: str, known: Mapping[str, Any]) -> str:
    match = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else ""
