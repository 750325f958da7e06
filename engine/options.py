"""Options declared once, as documented dataclass fields (`option(default, help)`); the command
line is generated from them: `options(cls)`, `add_options`, `values`, and `to_argv` (how
`pdserve up` hands options on). Imports no torch (docs/engine.md, "Module notes")."""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",  # noqa: A002
    *,
    flag: str | None = None,
    metavar: str | None = None,
    secret: bool = False,
) -> Any:
    """A config field that is also a command-line option (see the module docstring). A `secret`
    one is left out of the config's repr."""
    if not help:
        raise TypeError("an option needs its help text")
    return dataclasses.field(
        default=default, repr=not secret, metadata={"help": help, "flag": flag, "metavar": metavar, "secret": secret}
    )


class PortError(ValueError, argparse.ArgumentTypeError):
    """A value that is no TCP port: argparse prints its message as it is, and a ValueError elsewhere."""


def port(text: Any) -> int:
    """A TCP port, 0-65535 (0: the system picks a free one), from a flag's text or a file's value;
    the type of every port flag (`--port`, and each option whose field ends in `_port`)."""
    try:
        v = read_value(int, text)
    except (TypeError, ValueError):
        raise PortError(f"{text!r} is not a port number") from None
    if not 0 <= v <= 65535:
        raise PortError(f"{v} is not a port (0-65535)")
    return v


class NumberError(ValueError, argparse.ArgumentTypeError):
    """A value that is no usable number: argparse prints its message as it is."""


def real(text: Any) -> float:
    """A finite number, the type of every float flag: NaN passes every `<` and `<=` check unseen
    (`--heartbeat-interval nan` started), and no option means anything by infinity."""
    try:
        v = read_value(float, text)
    except (TypeError, ValueError):
        raise NumberError(f"{text!r} is not a finite number") from None
    return v


# token counts that take vLLM's human-readable forms (`--max-model-len 128k`)
COUNTS = ("max_model_len", "max_num_batched_tokens")
_DECIMAL = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


class CountError(ValueError, argparse.ArgumentTypeError):
    """Text that is no count: argparse prints its message as it is, and a ValueError elsewhere."""


def count(text: Any) -> int:
    """An integer, or vLLM's human-readable form of one: SI suffixes are decimal (`128k` is 128,000,
    `25.6k` 25,600, `1M` 1,000,000), IEC ones binary (`32Ki` is 32,768), and `K`, as vLLM's older
    releases read it, too (`32K` is 32,768)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    t = str(text).strip()
    num, suffix = t.rstrip("kmgtKMGTi"), t[len(t.rstrip("kmgtKMGTi")) :]
    try:
        if not suffix:
            return int(num)
        if suffix in _DECIMAL:
            return int(float(num) * _DECIMAL[suffix])
        if suffix in _BINARY:
            return int(num) * _BINARY[suffix]
    except ValueError:
        pass
    raise CountError(f"{text!r} is not a count (an integer, or 128k / 1M / 32Ki as vLLM writes them)")


def seconds(text: Any) -> float:
    """A finite number of seconds >= 0 (`--drain-timeout`: 0 stops at once)."""
    v = real(text)
    if v < 0:
        raise NumberError(f"{text!r} is not a number of seconds >= 0")
    return v


def read_value(typ: Any, v: Any) -> Any:
    """A file's (YAML) value as `typ` (bool, int, float, str) reads it, or ValueError where reading
    would change it: a bool or None for anything else, a fractional number for an int (`int(8.5)`
    is 8), NaN or infinity for a float, a list or mapping for a single value."""
    if typ is bool:
        if not isinstance(v, bool):
            raise ValueError(f"{v!r} is not true or false")
        return v
    if v is None or isinstance(v, bool | list | tuple | dict):
        raise ValueError(f"{v!r} is not a single {typ.__name__}")
    if typ is int:
        if isinstance(v, float) and not v.is_integer():
            raise ValueError(f"{v!r} is not a whole number")
        return int(v)
    if typ is float:
        x = float(v)
        if not math.isfinite(x):
            raise ValueError(f"{v!r} is not a finite number")
        return x
    return typ(v)


@dataclass(frozen=True)
class Opt:
    """One option of a config dataclass, as the command line sees it."""

    name: str  # the dataclass field
    flag: str  # "--max-num-seqs"
    type: type  # int | float | str | bool (of each item, for a repeatable flag)
    default: Any  # the field's default (None where it has none)
    help: str
    choices: tuple | None = None
    repeat: bool = False  # tuple[...] field: the flag may be given several times
    metavar: str | None = None

    @property
    def is_port(self) -> bool:
        """A TCP port (a field named `*_port`): values outside 0-65535 are refused as they are read."""
        return self.type is int and self.name.endswith("_port")

    @property
    def dest(self) -> str:
        """The argparse destination: the flag's name with underscores (`--tp` -> `tp`)."""
        return self.flag.removeprefix("--").replace("-", "_")


def _scalar(tp) -> tuple[type, tuple | None]:
    if typing.get_origin(tp) is Literal:
        args = typing.get_args(tp)
        return type(args[0]), args
    if tp in (bool, int, float, str):
        return tp, None
    raise TypeError(f"no command-line form for {tp!r}")


def options(cls) -> list[Opt]:
    """Every option `cls` declares, in field order; a field declared without `option` is not one."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            continue
        tp = hints[f.name]
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            tp = str if str in args else args[0]  # `int | str` (a memory size) is read as text
        repeat = typing.get_origin(tp) is tuple
        if repeat:
            tp = typing.get_args(tp)[0]
        typ, choices = _scalar(tp)
        default = None if f.default is dataclasses.MISSING else f.default
        flag = f.metadata["flag"] or "--" + f.name.removesuffix("_s").replace("_", "-")
        out.append(Opt(f.name, flag, typ, default, f.metadata["help"], choices, repeat, f.metadata["metavar"]))
    return out


def _shown(v: Any) -> str:
    return ",".join(map(str, v)) if isinstance(v, tuple) else str(v)


def add_options(
    parser: argparse.ArgumentParser,
    opts: list[Opt],
    *,
    unset: bool = False,
    defaults: dict[str, Any] | None = None,
    note: str = "",
) -> None:
    """One flag per option. `unset`: every default is None (given or not, for merging with a
    file), the field's default shown in the help; `defaults` replace a field's default (by name);
    `note` is appended to every help text."""
    defaults = defaults or {}
    for o in opts:
        default = defaults.get(o.name, o.default)
        shown = "" if default in (None, (), "") else f" (default {_shown(default)})"
        kw: dict[str, Any] = dict(default=None if unset else default, help=o.help + shown + note)
        if o.type is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            typ = port if o.is_port else count if o.name in COUNTS else real if o.type is float else o.type
            kw.update(type=typ, metavar=o.metavar)
            if o.choices:
                kw["choices"] = o.choices
            if o.repeat:
                kw["action"] = "append"
                if not unset:
                    kw["default"] = None  # argparse appends to a given list; the field's default is ()
        parser.add_argument(o.flag, **kw)


def values(opts: list[Opt], ns: argparse.Namespace) -> dict[str, Any]:
    """field -> value from a parsed namespace."""
    out = {}
    for o in opts:
        v = getattr(ns, o.dest)
        out[o.name] = (o.default if v is None else tuple(v)) if o.repeat else v
    return out


def coerce(o: Opt, v: Any) -> Any:
    """A value from a file (YAML) as the flag would have read it; ValueError naming the option."""
    try:
        if o.repeat:
            return tuple(read_value(o.type, x) for x in (v if isinstance(v, list | tuple) else [v]))
        v = count(v) if o.name in COUNTS and isinstance(v, str) else read_value(o.type, v)
    except (TypeError, ValueError):
        raise ValueError(f"{o.dest}: cannot read {v!r} as {o.type.__name__}") from None
    if o.is_port:
        try:
            port(v)
        except PortError as e:
            raise ValueError(f"{o.dest}: {e}") from None
    if o.choices and v not in o.choices:
        raise ValueError(f"{o.dest}: {v!r} is not one of {', '.join(map(str, o.choices))}")
    return v


def to_argv(opts: list[Opt], vals: dict[str, Any]) -> list[str]:
    """The flags that give `vals` (field -> value); None leaves an option at its default."""
    by_name = {o.name: o for o in opts}
    unknown = sorted(set(vals) - set(by_name))
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(by_name)}")
    argv: list[str] = []
    for name, v in vals.items():
        o = by_name[name]
        if v is None:
            continue
        if o.type is bool:
            argv.append(o.flag if v else "--no-" + o.flag.removeprefix("--"))
        elif o.repeat:
            for x in v:
                argv += [o.flag, str(x)]
        else:
            argv += [o.flag, str(v)]
    return argv
