"""The `mhla` command line: wires the command modules and maps errors to exit codes.

Exit codes: 0 ok; 1 a check failed (certify); 2 usage or input error (one line ``mhla: error: ...``);
3 internal error; 130 / 143 interrupted by SIGINT / SIGTERM.

The package, by job (a command module parses options, calls the library and formats output):

- `registry`: the commands, in the order of `mhla --help`, and the module that registers each;
- `options`: option types shared by the commands, the parsing of option strings;
- `console`: human messages and warnings on stderr, JSON on stdout, progress bars;
- `help`: help pages without type placeholders;
- `convert`: `mhla convert`;
- `reduce`: `mhla reduce`;
- `generate`: `mhla generate teacher | assoc`;
- `featurize`: `mhla featurize` and `mhla merge`;
- `certify`: `mhla certify` (the witness, certificates on given inputs);
- `fit`: `mhla fit`, `mhla export-heads` and `mhla spectrum`;
- `predict`: `mhla predict`, `mhla rollout` and `mhla compare`;
- `blocks`: a layer as a sum of blocks: `fit` / `certify --blocks`, `predict` / `export-heads` of a blocks file;
- `inspect`: `mhla inspect`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from typing import Annotated, Any

from .._version import __version__

from .registry import COMMANDS  # noqa: F401 (the commands and their modules, loaded on demand)

_APP: Any = None


def _version_callback(value: bool) -> None:
    if value:
        import typer

        typer.echo(f"mhla {__version__}")
        raise typer.Exit(0)


def _build_app() -> Any:
    import typer

    from .help import HelpGroup

    app = typer.Typer(
        name="mhla",
        help="Learn single-layer multi-head linear attention exactly, certify identifiability, export heads.\n\n"
             "Example: mhla featurize data.h5 -o feats.h5 && mhla certify feats.h5 && mhla fit feats.h5 -o "
             "model.h5 && mhla export-heads model.h5 -o heads.h5\n\n"
             "Shell completion (typer's): mhla --install-completion, or for this shell only: "
             "eval \"$(mhla --show-completion bash)\"",
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        add_completion=True,  # typer's own --install-completion / --show-completion
        cls=HelpGroup,
        context_settings={"help_option_names": ["-h", "--help"]},
    )

    def _root(version: bool = False) -> None:
        """mhla: learn MHLA exactly (Algorithm 1 of Yau et al., NeurIPS 2025) and certify identifiability."""

    # the annotation as an object (a string would be resolved in this module's globals, without typer)
    _root.__annotations__ = {"version": Annotated[bool, typer.Option(
        "--version", callback=_version_callback, is_eager=True, help="Print the version and exit.")],
        "return": None}
    app.callback()(_root)
    return app


def __getattr__(name: str) -> Any:
    """`app`, the typer application, built on first use (not at import: start-up); its commands are
    registered when one is asked for (`registry`). `full_app`: a new application with every command
    registered up front, for tools that walk the commands (typer's `utils docs`, the docs' CLI reference)."""
    global _APP
    if name == "app":
        if _APP is None:
            _APP = _build_app()
        return _APP
    if name == "full_app":
        from .registry import register_all

        full = _build_app()
        register_all(full)
        return full
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _error(message: str, code: int = 2, path: str | None = None) -> int:
    """The one-line error on stderr and, when the run asked for --json and printed nothing yet, the error
    object on stdout (`error`, `exit_code`, the input's `path`)."""
    line = " ".join(str(message).split())  # one line, whatever the underlying library put in the message
    try:
        sys.stderr.write(f"mhla: error: {line}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    from .console import emit_error_json

    emit_error_json(line, code, path)
    return code


def _say_stderr(text: str) -> None:
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point; returns (and exits with) the exit code."""
    code = run(argv)
    formats = sys.modules.get("mhla_cli.io.formats")  # not imported by `mhla --version`
    if formats is not None and formats.hdf5_write_failed():
        # libhdf5 can crash at interpreter shutdown after a failed write (it retries the flush of
        # the already removed temporary file): the error is reported, so leave without teardown.
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    sys.exit(code)


def run(argv: list[str] | None = None) -> int:
    """Run the CLI without exiting the interpreter; returns the exit code.

    0 ok, 1 a check failed, 2 usage/input/output error (one line ``mhla: error: <file>: ...``),
    3 internal error, 128 + signal number when interrupted (130 SIGINT, 143 SIGTERM). With --json every
    run prints one JSON object on stdout: the command's, or on a failure that printed none an error
    object (`schema_version`, `error`, `exit_code`, `path`).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["--version"]:  # without typer, NumPy or h5py: paid by scripts that check the version
        return _print_version()
    import typer

    from ..errors import InputError, Refused
    from ..signals import Interrupted, check_interrupted, sigterm_as_exception
    from .console import emit_error_json, start_json_run
    from .options import in_options

    start_json_run(args)  # and the command line for the outputs' provenance, set when a command runs
    try:
        with sigterm_as_exception(), _file_warnings() as unverified:
            rv = __getattr__("app")(args=args, prog_name="mhla", standalone_mode=False)
            check_interrupted()  # a signal whose exception was swallowed still ends the run
        code = rv if isinstance(rv, int) else 0
        for line in unverified if code != 2 else ():
            _say_stderr(line)
        if code:
            emit_error_json(f"exit code {code}", code)
        return code
    except Refused as exc:  # its remedies in the words of the options
        return _error(str(in_options(exc)), 2, exc.path)
    except InputError as exc:
        return _error(str(exc), 2, exc.path)
    except Interrupted as exc:
        return _interrupted("interrupted" if exc.signum == signal.SIGINT else "terminated", 128 + int(exc.signum))
    except (KeyboardInterrupt, typer.Abort):
        return _interrupted("interrupted", 130)
    except MemoryError:
        return _error("out of memory: use a smaller --chunk-size or a machine with more memory")
    except BrokenPipeError:
        # stdout closed early (e.g. piped into head): not an error of ours.
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        except OSError:
            pass
        return 0
    except Exception as exc:  # noqa: BLE001
        return _unexpected(exc)


@contextlib.contextmanager
def _file_warnings() -> Iterator[list[str]]:
    """Collect the inputs read without an integrity check (errors.UnverifiedFileWarning), once each, as lines
    ``mhla: warning: ...`` that `run` prints when the command ends without an error (an error stays one line);
    other warnings are shown as Python shows them."""
    import warnings

    from ..errors import UnverifiedFileWarning

    said: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("once", UnverifiedFileWarning)
        shown = warnings.showwarning

        def show(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
            if issubclass(category, UnverifiedFileWarning):
                said.append(f"mhla: warning: {message}")
            else:
                shown(message, category, *args, **kwargs)

        warnings.showwarning = show
        yield said


def _print_version() -> int:
    """`mhla --version` on its own."""
    try:
        sys.stdout.write(f"mhla {__version__}\n")
        sys.stdout.flush()
    except BrokenPipeError:
        pass
    return 0


def _interrupted(msg: str, code: int) -> int:
    """A run ended by a signal: ``mhla: interrupted`` (or terminated) on stderr, the error object for --json."""
    from .console import emit_error_json

    _say_stderr(f"mhla: {msg}")
    emit_error_json(msg, code)
    return code


def _unexpected(exc: Exception) -> int:
    """The exit code of an exception no command mapped: typer's usage errors (2, with the command named), an
    operating-system error on a named file (2), anything else an internal error (3; MHLA_DEBUG=1 raises it).
    Called while `exc` is being handled."""
    from .help import note_first_path

    # Usage errors from typer's parser carry exit_code and format_message (typer's bundled click).
    if hasattr(exc, "format_message") and hasattr(exc, "exit_code"):
        if type(exc).__name__ == "NoArgsIsHelpError":
            from .console import emit_error_json

            emit_error_json("no arguments: the help was printed", 2)
            return 2  # typer has already printed the help
        msg = exc.format_message()
        ctx = getattr(exc, "ctx", None)
        note_first_path(ctx)  # the input parsed before the bad option, for the --json error object
        if ctx is not None:
            sub = ctx.command_path.replace("mhla", "", 1).strip()
            msg = f"{sub}: {msg}" if sub else msg
        return _error(msg, 2)
    if os.environ.get("MHLA_DEBUG"):
        raise exc
    if isinstance(exc, OSError) and getattr(exc, "filename", None):
        # An operating-system error on a named file (permissions, I/O error, ...).
        return _error(f"{exc.filename}: {exc.strerror or exc}", 2, str(exc.filename))
    return _error(f"internal error: {type(exc).__name__}: {exc} (set MHLA_DEBUG=1 for a traceback; "
                  "please report it)", 3)
