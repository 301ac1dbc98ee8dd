"""Command-line options generated from pydantic settings models: each option is one model field.

A field gives its option everything but the spelling of its flag: the name (``max_num_seqs`` →
``--max-num-seqs``; a bool → ``--x/--no-x``), the default, the help (the field's description, then
its default and bounds once: ``[default: 32; x>=1]``) and the validation (the model's own, field
and model validators included, so a bad value is refused by the field's name). What only the
command line says, a field carries as :class:`Flag` metadata: other flag names (``--seats``,
``-c``), a default of its own (``carpool serve``'s are None, "not given", so a ``--config``
file's settings stand), a parser for text that is not the field's type (``8MiB``, JSON).

The settings of ``carpool serve`` live in ``replica/config``, ``router/config.py`` and
``cluster/``; they hold no CLI metadata: the command lists its options as :func:`option` (a
model's field, with its :class:`Flag`). A model that exists for the command line alone (the
bench's, ``cluster/bench/options.py``) writes its :class:`Flag` into the field's ``Annotated``
type, and :func:`options_of` takes every field.

:func:`command` registers a typer command with these options; its body receives a
:class:`Given` (the values, parsed and validated per model).
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Callable, Sequence
from enum import Enum
from pathlib import Path
from typing import Any, List, Literal, Optional

import annotated_types
import typer
from pydantic import BaseModel, ByteSize, ValidationError
from pydantic_core import PydanticUndefined

FIELD_DEFAULT: Any = object()
"""A :class:`Flag`'s default when the option's default is the field's own."""


@dataclasses.dataclass(frozen=True)
class Flag:
    """How one field is spelled and read on a command line (everything else comes from the field).

    ``decls``: the flag names (default ``--field-name``, a bool ``--field-name/--no-field-name``);
    ``default``: the option's default when not the field's; ``parse``: text → the field's value,
    raising ``ValueError`` (applied to each value of a ``multiple`` option); ``multiple``: the option
    may repeat; ``envvar``: read from this environment variable when not given; ``metavar``: the
    value's placeholder in ``--help`` (default: from the field's type); ``note``: appended to the
    description, for what the command line alone takes (a unit, a JSON object)."""

    decls: tuple[str, ...] = ()
    default: Any = FIELD_DEFAULT
    parse: Callable[[str], Any] | None = None
    multiple: bool = False
    envvar: str | None = None
    metavar: str | None = None
    note: str = ""


def flag(*decls: str, **settings: Any) -> Flag:
    """A :class:`Flag` with these flag names (``flag("--max-num-seqs", "--seats")``)."""
    return Flag(decls=decls, **settings)


@dataclasses.dataclass(frozen=True)
class Opt:
    """One option: ``model``'s field ``field``, spelled by ``flag``; its value goes to the section
    ``to`` of the command's settings (``"engine"``, ``"autoscaling"``; None: the top level)."""

    model: type[BaseModel]
    field: str
    flag: Flag
    to: str | None = None

    @property
    def info(self):
        return self.model.model_fields[self.field]

    @property
    def name(self) -> str:
        """The parameter's name: the field's."""
        return self.field

    @property
    def is_bool(self) -> bool:
        return _base_type(self.info.annotation) is bool

    @property
    def default(self) -> Any:
        """The option's default (None for "not given")."""
        if self.flag.default is not FIELD_DEFAULT:
            return self.flag.default
        return None if self.info.default is PydanticUndefined else self.info.default

    def decls(self) -> tuple[str, ...]:
        name = "--" + self.field.replace("_", "-")
        if self.flag.decls:
            return self.flag.decls
        return (f"{name}/--no-{name[2:]}",) if self.is_bool else (name,)

    def shown(self) -> str:
        """The first flag name, as messages name the option (``--max-num-seqs``)."""
        return self.decls()[0].split("/")[0]


def option(model: type[BaseModel], field: str, *decls: str, to: str | None = None, **settings: Any) -> Opt:
    """``model``'s field ``field`` as an option (``decls`` and ``settings``: its :class:`Flag`).

    Raises ``KeyError`` when the model has no such field."""
    if field not in model.model_fields:
        raise KeyError(f"{model.__name__} has no field {field!r}")
    return Opt(model, field, Flag(decls=decls, **settings), to)


def options_of(model: type[BaseModel], to: str | None = None) -> list[Opt]:
    """Every field of ``model`` as an option, spelled by the :class:`Flag` in its ``Annotated``
    type if it has one."""
    opts = []
    for name, info in model.model_fields.items():
        flags = [m for m in info.metadata if isinstance(m, Flag)]
        opts.append(Opt(model, name, flags[0] if flags else Flag(), to))
    return opts


# ---- help text ---------------------------------------------------------------------------------

def _base_type(annotation: Any) -> Any:
    """The type under ``Optional``/``Annotated`` (``int | None`` → ``int``)."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(args) != 1:
                return annotation
            annotation = args[0]
        else:
            return annotation


def _metavar(opt: Opt) -> str:
    if opt.flag.metavar:
        return opt.flag.metavar
    kind = _base_type(opt.info.annotation)
    names = {int: "int", float: "float", str: "str", Path: "path", ByteSize: "size"}
    if kind in names:
        return f"<{names[kind]}>"
    parts = typing.get_args(kind) if typing.get_origin(kind) in (typing.Union, types.UnionType) else (kind,)
    words = []
    for part in parts:
        if typing.get_origin(part) is Literal:
            words += [str(v) for v in typing.get_args(part)]
        else:
            words.append(names.get(part, "value"))
    return "<" + "|".join(words) + ">"


def _shown_default(value: Any, is_bool: bool) -> str | None:
    if value is None or value is PydanticUndefined or value == [] or value == {}:
        return None
    if is_bool:
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value)
    if isinstance(value, Enum):
        return str(value.value)
    return str(value)


def _bounds(opt: Opt) -> str | None:
    """The field's numeric bounds as click writes a range (``x>=1``, ``0<x<=1``)."""
    low = high = None
    for m in opt.info.metadata:
        if isinstance(m, annotated_types.Ge):
            low = (m.ge, "<=")
        elif isinstance(m, annotated_types.Gt):
            low = (m.gt, "<")
        elif isinstance(m, annotated_types.Le):
            high = (m.le, "<=")
        elif isinstance(m, annotated_types.Lt):
            high = (m.lt, "<")
    if low and high:
        return f"{low[0]}{low[1]}x{high[1]}{high[0]}"
    if low:
        return f"x{'>=' if low[1] == '<=' else '>'}{low[0]}"
    if high:
        return f"x{high[1]}{high[0]}"
    return None


def help_text(opt: Opt) -> str:
    """The field's description (and the flag's note), then its default and bounds once:
    ``Seats: requests running in one batch at most.  [default: 32; x>=1]``. The default shown is
    the option's, else (an option that defaults to "not given") the field's."""
    text = " ".join(part for part in ((opt.info.description or "").strip(), opt.flag.note) if part)
    default = opt.default if opt.default is not None else opt.info.default
    extra = [f"default: {shown}"] if (shown := _shown_default(default, opt.is_bool)) else []
    if bounds := _bounds(opt):
        extra.append(bounds)
    return f"{text}  [{'; '.join(extra)}]" if extra else text


# ---- the command ---------------------------------------------------------------------------------

def _parameter(opt: Opt) -> inspect.Parameter:
    """The typer parameter of one option: bools as click flags, everything else as text, which
    the model then validates (so its errors name the field, not click's type)."""
    default = opt.default
    if opt.is_bool:
        annotation: Any = bool if default is not None else Optional[bool]
    elif opt.flag.multiple:
        annotation = List[str] if default is not None else Optional[List[str]]
    else:
        annotation = str if default is not None else Optional[str]
    info = typer.Option(
        default, *opt.decls(), help=help_text(opt), show_default=False, envvar=opt.flag.envvar,
        metavar=None if opt.is_bool else _metavar(opt),
    )
    return inspect.Parameter(opt.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=annotation)


class Given:
    """A command's option values: parsed (:attr:`Flag.parse`), by field, and validated by model.

    ``fail(message)`` ends the command; it is called with ``"<field> (<flag>): <problem>"``, or
    ``"invalid options:"`` and such a line per bad field."""

    def __init__(self, opts: Sequence[Opt], raw: dict[str, Any], fail: Callable[[str], Any]) -> None:
        self.opts, self.fail, self.values = list(opts), fail, {}
        for opt in self.opts:
            value = raw[opt.name]
            if opt.flag.parse is not None and value is not None:
                try:
                    value = [opt.flag.parse(v) for v in value] if opt.flag.multiple else opt.flag.parse(value)
                except ValueError as exc:
                    fail(f"{_path(opt.to, opt.field)} ({opt.shown()}): {exc}")
            self.values[opt.name] = value

    def section(self, to: str | None, model: type[BaseModel] | None = None) -> dict[str, Any]:
        """The values bound for section ``to`` (of ``model`` alone, if given), by field; None
        where an option was not given. Not validated: the caller builds its settings from them."""
        return {o.field: self.values[o.name] for o in self.opts if o.to == to and (model is None or o.model is model)}

    def validated(self, *sections: str | None) -> dict[str, Any]:
        """The values (of the options bound for ``sections``, or all), by parameter name, after
        each model validates the values of its options (those not given left to the model's
        defaults, and returned as None): a bad one ends the command, named by its field and flag,
        one line each."""
        out: dict[str, Any] = {}
        groups = dict.fromkeys((o.model, o.to) for o in self.opts if not sections or o.to in sections)
        for model, to in groups:
            mine = [o for o in self.opts if o.model is model and o.to == to]
            given = {o.field: self.values[o.name] for o in mine if self.values[o.name] is not None}
            try:
                settings = model.model_validate(given)
            except ValidationError as exc:
                self.fail("invalid options:\n" + _errors(exc, mine, to))
            for o in mine:
                value = getattr(settings, o.field) if o.field in given else None
                out[o.name] = value.model_dump() if isinstance(value, BaseModel) else value
        return out


def _path(to: str | None, field: str) -> str:
    return f"{to}.{field}" if to else field


def _errors(exc: ValidationError, opts: Sequence[Opt], to: str | None) -> str:
    """One line per bad field, its flag beside it: ``  max_num_seqs (--max-num-seqs): Input should
    be greater than or equal to 1 (got 0)``."""
    flags = {o.field: o.shown() for o in opts}
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        where = _path(to, ".".join(loc)) if loc else (to or "options")
        if loc and loc[0] in flags:
            where += f" ({flags[loc[0]]})"
        msg = str(err["msg"]).removeprefix("Value error, ")
        given = err.get("input")
        shown = "" if isinstance(given, dict) or err["type"] in ("missing", "value_error") else f" (got {given!r})"
        lines.append(f"  {where}: {msg}{shown}")
    return "\n".join(dict.fromkeys(lines))


def command(
    app: typer.Typer, name: str, opts: Sequence[Opt], *, fail: Callable[[str], Any], context: bool = False,
    **settings: Any,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``name`` on ``app`` with ``opts`` as its options; the decorated body is called
    with a :class:`Given` (and the click context first, with ``context=True``). ``settings`` go
    to ``app.command`` (``context_settings``...).

    Raises ``ValueError`` when two options share a parameter name or a flag."""
    names = [o.name for o in opts]
    flags = [d for o in opts for decl in o.decls() for d in decl.split("/")]
    if len(set(names)) != len(names) or len(set(flags)) != len(flags):
        raise ValueError(f"{name}: options share a name or a flag: {sorted(names)} {sorted(flags)}")

    def decorate(body: Callable[..., Any]) -> Callable[..., Any]:
        params = [_parameter(o) for o in opts]
        if context:
            params.insert(0, inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context))

        def run(**raw: Any) -> Any:
            ctx = raw.pop("ctx", None)
            given = Given(opts, raw, fail)
            return body(ctx, given) if context else body(given)

        run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in params}
        run.__name__, run.__doc__, run.__module__ = body.__name__, body.__doc__, body.__module__
        app.command(name, **settings)(run)
        return body

    return decorate
