"""The ``hybrid`` command line: ``estimate``, ``plan``, ``launch``, ``monitor``, ``checkpoint``, ``data``.

Each command lives in its own module under ``launch/commands/`` and is registered here. A ``UserError``
from anywhere below becomes one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import sys

import click

from hybrid.errors import UserError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="hybrid-parallel")
def cli() -> None:
    """hybrid: tensor parallelism inside each node, ZeRO across nodes, launched on Ray."""


def _register() -> None:
    from launch.commands import ALL_COMMANDS

    for command in ALL_COMMANDS:
        cli.add_command(command)


def main(argv=None) -> int:
    _register()
    try:
        cli.main(args=argv, prog_name="hybrid", standalone_mode=False)
    except UserError as err:
        click.echo(f"error: {err}", err=True)
        return 2
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except click.ClickException as err:
        err.show()
        return 2
    except click.exceptions.Exit as done:
        return done.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
