"""The commands of `mhla`, in the order of `mhla --help`, and the module of mhla_cli.cli that registers each.

A module is imported only when one of its commands is run, shown or completed (`help.HelpGroup.get_command`):
`mhla certify --help` loads certify's parser, not fit's solvers. A new command module adds its commands here.
`register_all` registers every command at once, for tools that walk a click tree (the docs' CLI reference).
"""

from __future__ import annotations

from typing import Any

COMMANDS = {
    "generate": "generate", "convert": "convert", "reduce": "reduce", "featurize": "featurize", "merge": "featurize",
    "certify": "certify", "fit": "fit", "export-heads": "fit", "spectrum": "fit", "predict": "predict",
    "rollout": "predict", "compare": "predict", "inspect": "inspect",
}


def register_all(app: Any) -> None:
    """Register every command of `COMMANDS` on the typer app `app`, each module once, in the order above."""
    import importlib

    for module in dict.fromkeys(COMMANDS.values()):
        importlib.import_module(f"{__package__}.{module}").register(app)
