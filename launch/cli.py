"""The ``hybrid`` command line: ``estimate``, ``plan``, ``probe``, ``launch``, ``monitor``, ``checkpoint``, ``data``.

Each command lives in its own module under ``launch/commands/`` and is registered here. ``main`` returns
the process's exit status: 0 success, 1 the job failed (a command raised ``click.exceptions.Exit(1)``),
2 a ``UserError`` or a usage error (one ``error:`` line on stderr, never a traceback; a usage error ends with
the command's ``--help`` as its fix; a group without its command prints its help first), 130 interrupted by
SIGINT, SIGTERM or SIGHUP unless ignored (schedulers stop jobs with SIGTERM, a closed terminal sends SIGHUP;
all raise ``KeyboardInterrupt`` here, so every ``finally`` teardown below runs).
"""

from __future__ import annotations

import signal
import sys

import click

from hybrid.errors import UserError
from launch.job import signals

from launch.exit_codes import EXIT_INTERRUPTED, EXIT_OK, EXIT_USER_ERROR


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
    with signals.as_interrupt(*signals.with_hangup((signal.SIGTERM,))):
        try:
            code = cli.main(args=argv, prog_name="hybrid", standalone_mode=False)
        except click.exceptions.NoArgsIsHelpError as err:  # a group without its command: help, then one line
            click.echo(err.format_message())
            click.echo(f"error: {_missing_command(err.ctx)}", err=True)
            return EXIT_USER_ERROR
        except UserError as err:
            click.echo(f"error: {err}", err=True)
            return EXIT_USER_ERROR
        except (click.exceptions.Abort, KeyboardInterrupt):
            click.echo("interrupted", err=True)
            return EXIT_INTERRUPTED
        except click.UsageError as err:  # a bad option, a missing argument: click's sentence, then the fix
            click.echo(f"error: {_usage_sentence(err, sys.argv[1:] if argv is None else argv)}", err=True)
            return EXIT_USER_ERROR
        except click.ClickException as err:
            click.echo(f"error: {err.format_message()}", err=True)
            return EXIT_USER_ERROR
        except click.exceptions.Exit as done:
            return done.exit_code
    return code if isinstance(code, int) else EXIT_OK


def _usage_sentence(err: click.UsageError, argv: list) -> str:
    """click's sentence for a usage error ("No such option '--bogus'.") with where the right usage is: the
    command's help (click leaves the context out of some errors: then the command named first in ``argv``)."""
    if err.ctx is not None:
        path = err.ctx.command_path
    else:
        path = "hybrid" + (f" {argv[0]}" if argv and argv[0] in cli.commands else "")
    return f"{err.format_message().rstrip('.')}; see {path} --help."


def _missing_command(ctx: click.Context) -> str:
    names = sorted(ctx.command.list_commands(ctx)) if isinstance(ctx.command, click.Group) else []
    shown = ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else "".join(names)
    return f"{ctx.command_path} needs a command: {shown} (see {ctx.command_path} COMMAND --help)."


if __name__ == "__main__":
    sys.exit(main())
