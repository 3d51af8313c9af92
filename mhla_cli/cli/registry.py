"""The commands of `mhla`, in the order of `mhla --help`, and the module of mhla_cli.cli that registers each.

A module is imported only when one of its commands is run, shown or completed (`help.HelpGroup.get_command`):
`mhla certify --help` loads certify's parser, not fit's solvers. A new command module adds its commands here.
"""

from __future__ import annotations

COMMANDS = {
    "generate": "generate", "convert": "convert", "reduce": "reduce", "featurize": "featurize", "merge": "featurize",
    "certify": "certify", "fit": "fit", "export-heads": "fit", "spectrum": "fit", "predict": "predict",
    "rollout": "predict", "compare": "predict", "inspect": "inspect",
}
