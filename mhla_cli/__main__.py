"""`python -m mhla_cli` runs the `mhla` command line."""

from mhla_cli.cli import main

main()
