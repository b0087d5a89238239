"""Settings declared once: a dataclass field states its type, default and help, and its
command-line flag, its environment variable and the parsing of both are derived from it.

A component's settings class (``GatewaySettings``, ``WorkerSettings`` with
``ChannelSettings``, ``InferenceServerSettings``) is the one place a setting is written
down. ``add_flags`` gives every declared field a flag (``--field-name`` unless the field
names another); ``resolve`` takes the flags given, then ``TRAJBUS_<COMPONENT>_<FIELD>``
variables, and leaves the rest to the class defaults; ``parse_text`` is the one rule that
turns text into a field's value (flags, environment, ``--channel-setting``, the demo's
YAML), typed by pydantic from the annotation. pydantic-settings was not used: its CLI
source wants a parser of its own, and trajbus's commands share one argparse tree.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from pydantic import TypeAdapter, ValidationError

SETTING = "trajbus.setting"
NONE_WORDS = ("none", "off", "")
"""Text that means "not set" for a setting that may be None (``--max-staleness off``)."""


@dataclass(frozen=True)
class Declared:
    """How a settings field appears outside the code."""

    help: str
    flag: str | None = None
    """The flag, when not ``--`` + the field name with dashes (kept names of the seed design)."""
    parse: Callable[[str], Any] | None = None
    """Text -> value where the annotation says too little (a positive integer, a list of addresses)."""
    choices: tuple[str, ...] | None = None
    repeat: bool = False
    """The flag may be given many times; the field holds the parsed values in order."""


def setting(default: Any = dataclasses.MISSING, *, help: str, flag: str | None = None,
            parse: Callable[[str], Any] | None = None, choices: tuple[str, ...] | None = None,
            repeat: bool = False, default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field declared as a setting (no default: a required flag)."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={SETTING: Declared(help, flag, parse, choices, repeat)})


def declared_fields(cls: type) -> list[tuple[dataclasses.Field, Declared, Any]]:
    """(field, declaration, type) of each declared setting of ``cls``, in declaration order."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return [(f, f.metadata[SETTING], hints[f.name]) for f in dataclasses.fields(cls) if SETTING in f.metadata]


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata[SETTING].flag or "--" + f.name.replace("_", "-")


def env_var(env_prefix: str, name: str) -> str:
    return f"{env_prefix}{name.upper()}"


def is_required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def missing_flags(cls: type, values: Mapping[str, Any]) -> list[str]:
    """The flags of required settings ``values`` lacks (given neither as a flag nor as a variable)."""
    return [flag_of(f) for f, _, _ in declared_fields(cls) if is_required(f) and f.name not in values]


def default_of(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def _optional(hint: Any) -> bool:
    return type(None) in typing.get_args(hint)


def _describe(hint: Any) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "text", Path: "a path"}
    base = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
    return names.get(base, str(base)) + (" or off" if _optional(hint) else "")


def parse_text(f: dataclasses.Field, hint: Any, text: str) -> Any:
    """The value of setting ``f`` written as ``text``; ``ValueError`` saying what was expected."""
    declared: Declared = f.metadata[SETTING]
    if _optional(hint) and text.strip().lower() in NONE_WORDS:
        return None
    if declared.choices is not None and text not in declared.choices:
        raise ValueError(f"expected one of {', '.join(declared.choices)}, got {text!r}")
    if declared.parse is not None:
        try:
            return declared.parse(text)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(str(exc)) from None
    try:
        return TypeAdapter(hint).validate_strings(text.strip())
    except ValidationError:
        raise ValueError(f"expected {_describe(hint)}, got {text!r}") from None


def _known(classes: tuple[type, ...]) -> dict[str, tuple[dataclasses.Field, Declared, Any]]:
    return {f.name: (f, declared, hint) for cls in classes for f, declared, hint in declared_fields(cls)}


def setting_value(cls: type, name: str, text: str, what: str = "setting") -> Any:
    """``parse_text`` by field name (``--channel-setting CHANNEL.NAME=VALUE``); ``ValueError`` names it."""
    known = _known((cls,))
    if name not in known:
        raise ValueError(f"{name}: not a {what}")
    f, _, hint = known[name]
    try:
        return parse_text(f, hint, text)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _flag_options(f: dataclasses.Field, declared: Declared, hint: Any, shown: str) -> dict[str, Any]:
    """argparse's options of one declared field: its help (ending in ``shown``), its value's parsing."""
    options: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS,
                               "help": f"{declared.help} ({shown})".replace("%", "%%")}
    if hint is bool:
        options["action"] = argparse.BooleanOptionalAction
        return options

    def parse(value: str, f: dataclasses.Field = f, hint: Any = hint) -> Any:
        try:
            return parse_text(f, hint, value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = f.name  # argparse names the type in its error
    options.update(type=parse, action="append" if declared.repeat else "store")
    options["metavar"] = "{" + ",".join(declared.choices) + "}" if declared.choices else None
    return options


def _shown_default(f: dataclasses.Field) -> str:
    default = default_of(f)
    return "required" if is_required(f) else f"default: {'off' if default is None else default}"


def add_flags(parser: argparse.ArgumentParser | Any, cls: type, env_prefix: str) -> None:
    """A flag per declared field of ``cls`` on ``parser`` (or an argument group); an absent flag leaves
    the field to ``resolve``."""
    for f, declared, hint in declared_fields(cls):
        shown = f"{_shown_default(f)}; ${env_var(env_prefix, f.name)}"
        parser.add_argument(flag_of(f), **_flag_options(f, declared, hint, shown))


def add_flag(parser: argparse.ArgumentParser | Any, cls: type, name: str) -> None:
    """The flag of one declared field of ``cls``, for a command that reads it without the class (``trajbus
    stats --prefix``): absent, it holds the field's default; no environment variable."""
    f, declared, hint = _known((cls,))[name]
    options = _flag_options(f, declared, hint, _shown_default(f))
    options["default"] = default_of(f)
    parser.add_argument(flag_of(f), **options)


def resolve(cls: type, args: argparse.Namespace, env_prefix: str,
            environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The declared settings given: each flag, else its environment variable (``ValueError`` naming
    the variable); a setting given neither way is absent, so the class default applies."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f, declared, hint in declared_fields(cls):
        name = env_var(env_prefix, f.name)
        if f.name in vars(args):
            values[f.name] = getattr(args, f.name)
        elif name in environ:
            try:
                texts = environ[name].split() if declared.repeat else [environ[name]]
                parsed = [parse_text(f, hint, text) for text in texts]
            except ValueError as exc:
                raise ValueError(f"${name}: {exc}") from None
            values[f.name] = parsed if declared.repeat else parsed[0]
    return values


def check_values(classes: tuple[type, ...], values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A config file's section of settings (e.g. the demo's ``gateway:``), checked by the rule of the
    flags; ``ValueError`` naming ``where.name``."""
    known = _known(classes)
    checked: dict[str, Any] = {}
    for name, value in values.items():
        if name not in known:
            raise ValueError(f"{where}.{name}: unknown setting (known: {', '.join(known)})")
        f, declared, hint = known[name]
        try:
            items = value if declared.repeat else [value]
            parsed = [None if item is None else parse_text(f, hint, str(item)) for item in items]
        except ValueError as exc:
            raise ValueError(f"{where}.{name}: {exc}") from None
        checked[name] = parsed if declared.repeat else parsed[0]
    return checked


def to_flags(classes: tuple[type, ...], values: Mapping[str, Any]) -> list[str]:
    """The command line that sets ``values`` (None: not set), e.g. to start a service with a config's settings."""
    known = _known(classes)
    arguments: list[str] = []
    for name, value in values.items():
        if name not in known:
            raise ValueError(f"{name}: not a setting of {', '.join(c.__name__ for c in classes)}")
        f, declared, _ = known[name]
        if value is None:
            continue
        if isinstance(value, bool):
            arguments.append(flag_of(f) if value else "--no-" + flag_of(f)[2:])
        else:
            for item in value if declared.repeat else [value]:
                arguments += [flag_of(f), str(item)]
    return arguments
