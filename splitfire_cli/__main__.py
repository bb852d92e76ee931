"""`python -m splitfire_cli`: the `splitfire` executable."""

from splitfire_cli import cli

cli()
