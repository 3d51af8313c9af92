"""The `mhla` command line: wires the command modules and maps errors to exit codes.

Exit codes: 0 ok; 1 a check failed (certify); 2 usage or input error (one line ``mhla: error: ...``);
3 internal error; 130 / 143 interrupted by SIGINT / SIGTERM.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from .. import __version__
from ..errors import InputError
from ..formats import Interrupted, sigterm_as_exception

app = typer.Typer(
    name="mhla",
    help="Learn single-layer multi-head linear attention exactly, certify identifiability, export heads.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"mhla {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version_callback, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """mhla: learn MHLA exactly (Algorithm 1 of Yau et al., NeurIPS 2025) and certify identifiability."""


from . import core  # noqa: E402

core.register(app)


def _error(message: str, code: int = 2) -> int:
    sys.stderr.write(f"mhla: error: {message}\n")
    sys.stderr.flush()
    return code


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point; returns (and exits with) the exit code."""
    code = run(argv)
    sys.exit(code)


def run(argv: list[str] | None = None) -> int:
    """Run the CLI without exiting the interpreter; returns the exit code."""
    try:
        with sigterm_as_exception():
            rv = app(args=argv, prog_name="mhla", standalone_mode=False)
        return rv if isinstance(rv, int) else 0
    except InputError as exc:
        return _error(str(exc))
    except Interrupted:
        sys.stderr.write("mhla: terminated\n")
        return 143
    except KeyboardInterrupt:
        sys.stderr.write("mhla: interrupted\n")
        return 130
    except MemoryError:
        return _error("out of memory: use a smaller --chunk-size or a machine with more memory")
    except BrokenPipeError:
        # stdout closed early (e.g. piped into head): not an error of ours.
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        except OSError:
            pass
        return 0
    except typer.Abort:
        sys.stderr.write("mhla: aborted\n")
        return 130
    except Exception as exc:  # noqa: BLE001
        # Usage errors from typer's parser carry exit_code and format_message (typer's bundled click).
        if hasattr(exc, "format_message") and hasattr(exc, "exit_code"):
            if type(exc).__name__ == "NoArgsIsHelpError":
                return 2  # typer has already printed the help
            msg = exc.format_message()
            ctx = getattr(exc, "ctx", None)
            if ctx is not None:
                sub = ctx.command_path.replace("mhla", "", 1).strip()
                msg = f"{sub}: {msg}" if sub else msg
            return _error(msg, 2)
        if os.environ.get("MHLA_DEBUG"):
            raise
        return _error(f"internal error: {type(exc).__name__}: {exc} (set MHLA_DEBUG=1 for a traceback; "
                      "please report it)", 3)
