"""Help pages without type placeholders: flags show none, values a click-style name (PATH, FLOAT).

typer 0.29 prints ``<bool>`` after every flag, ``<path>`` after every argument and ``<list[Path]>``
after a variadic one. `HelpGroup` (the class of the `mhla` app and its sub-apps) swaps the
classes of its commands' parameters for ones that print no placeholder on a flag or an argument
(whose name, e.g. DATA or PART..., already says it) and an upper-case value name on an option
(``--output PATH``, ``--ridge FLOAT``, ``--files PATH...``). Parsing is untouched.
"""

from __future__ import annotations

from typing import Any

from typer import _click
from typer._coercion import PassThroughRuntimeParam
from typer.core import TyperArgument, TyperGroup, TyperOption

# annotation -> the value name shown after an option (click's names)
_NAMES = {int: "INTEGER", float: "FLOAT", str: "TEXT", bool: "BOOLEAN"}


class _Argument(TyperArgument):
    @property
    def display_name_raw(self) -> str:
        return self.metavar if self.metavar is not None else str(self.name).upper()

    def display_type_rich(self, ctx: _click.Context) -> str | None:
        return None  # the name column (DATA, PART...) is the placeholder

    def _usage_display_name(self) -> str:
        name = self.display_name_raw
        if self.nargs != 1 and not name.endswith("..."):
            name += "..."
        return name if self.required else f"[{name}]"


class _Option(TyperOption):
    def get_runtime_param(self) -> Any:
        # A flag's value is a bool, or None when not given, and typer's coercion passes both through
        # unchanged (RuntimeParam.coerce returns None for None; process_value skips bools): a flag needs no
        # pydantic TypeAdapter. Building one imports typer._adapters and pydantic (~0.1-0.2 s), which the
        # root's --help / completion flags (None when absent) would pay on every `mhla CMD --help`.
        if self._runtime_param is None and self.is_flag and self.type_descriptor.annotation is bool:
            self._runtime_param = PassThroughRuntimeParam(annotation=bool,
                                                          parameter_info=self.type_descriptor.parameter_info)
        return super().get_runtime_param()

    def display_type_rich(self, ctx: _click.Context) -> str | None:
        if self.is_flag or self.count:
            return None
        if self.metavar is not None:
            return self.metavar
        return value_name(self)


def value_name(param: Any) -> str:
    """PATH, INTEGER, FLOAT, TEXT or [A|B] (choices) for an option's value; '...' when it repeats."""
    desc = param.type_descriptor
    if desc.is_choice and desc.choices is not None:
        name = "[" + "|".join(str(getattr(c, "value", c)) for c in desc.choices) + "]"
    elif desc.is_path:
        name = "PATH"
    else:
        ann = desc.annotation
        if desc.is_list:
            args = getattr(ann, "__args__", ())
            ann = args[0] if args else str
        name = _NAMES.get(ann, "PATH" if getattr(ann, "__name__", "") in ("Path", "PurePath") else "VALUE")
    return name + ("..." if param.nargs != 1 or desc.is_list else "")


def unwrap(text: str | None) -> str | None:
    """A help text whose paragraphs are single lines, for the console to wrap at its width: the line breaks
    inside a paragraph of a docstring are hard wraps, not structure (list items stay on their lines)."""
    if not text:
        return text
    paragraphs = []
    for para in text.strip().split("\n\n"):
        lines = [ln.strip() for ln in para.splitlines() if ln.strip()]
        out: list[str] = []
        for ln in lines:
            if out and not ln.startswith(("- ", "* ", "$ ")):
                out[-1] += " " + ln
            else:
                out.append(ln)
        paragraphs.append("\n".join(out))
    return "\n\n".join(paragraphs)


def plain_params(command: Any, ctx: _click.Context) -> None:
    """Swap the parameter classes of `command` (and, for a group, of its commands) in place, and unwrap its
    help text (`unwrap`)."""
    command.help = unwrap(command.help)
    params = command.get_params(ctx)  # includes the --help option, made on first use
    for p in params:
        if type(p) is TyperOption:
            p.__class__ = _Option
        elif type(p) is TyperArgument:
            p.__class__ = _Argument
    for sub in getattr(command, "commands", {}).values():
        plain_params(sub, ctx)
    if not hasattr(command, "commands") and not getattr(command, "_mhla_notes_input", False):
        command.invoke = _noting_input(command.invoke)
        command._mhla_notes_input = True


def _noting_input(invoke: Any) -> Any:
    """`invoke` of a command that first records its input (the first path argument) for --json errors."""
    def wrapped(ctx: _click.Context) -> Any:
        from .console import command_started
        from .options import check_common_params

        note_first_path(ctx)
        check_common_params(ctx)
        command_started()
        return invoke(ctx)
    return wrapped


def note_first_path(ctx: Any) -> None:
    """Record the first path argument parsed in `ctx` (if any) as the run's input."""
    from .console import note_input

    for p in getattr(getattr(ctx, "command", None), "params", ()):
        value = ctx.params.get(p.name) if isinstance(p, TyperArgument) else None
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            note_input(value)
            return


def _is_root(group: Any, ctx: _click.Context) -> bool:
    """Whether `group` is the `mhla` group itself in `ctx` (its commands load on demand), not a sub-group
    (`generate`) walked in the root's context by a documentation tool."""
    return ctx.parent is None and ctx.command is group


class HelpGroup(TyperGroup):
    """A typer group whose help pages (its own and its commands') show no type placeholders."""

    def get_params(self, ctx: _click.Context) -> list[Any]:
        self.help = unwrap(self.help)
        params = super().get_params(ctx)
        for p in params:
            if type(p) is TyperOption:
                p.__class__ = _Option
        return params

    def list_commands(self, ctx: _click.Context) -> list[str]:
        from .registry import COMMANDS

        names = list(super().list_commands(ctx))
        # the registry's order; at the root also the commands not loaded yet (a fully registered app, or a
        # group walked from another tool's context, lists what it holds)
        known = [n for n in COMMANDS if _is_root(self, ctx) or n in names]
        return known + [n for n in names if n not in COMMANDS]

    def get_command(self, ctx: _click.Context, cmd_name: str) -> Any:
        if cmd_name not in self.commands and _is_root(self, ctx):
            self._load(cmd_name)
        cmd = super().get_command(ctx, cmd_name)
        if cmd is not None:
            plain_params(cmd, ctx)
        return cmd

    def _load(self, cmd_name: str) -> None:
        """Register the commands of the module that defines `cmd_name` (mhla_cli.cli.COMMANDS)."""
        import importlib

        import typer

        from .registry import COMMANDS

        module = COMMANDS.get(cmd_name)
        if module is None:
            return
        sub = typer.Typer()
        importlib.import_module(f"{__package__}.{module}").register(sub)
        for name, cmd in typer.main.get_group(sub).commands.items():
            self.commands.setdefault(name, cmd)
