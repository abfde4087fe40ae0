"""The ``kaisa`` command: ``kaisa demo``, ``kaisa plan``, ``kaisa --version``.

``kaisa demo ...`` runs the time-to-accuracy benchmark suite (``kaisa.demo``,
from a checkout) and ``kaisa plan ...`` prints the KAISA work plan and cost
model (``kaisa.cli.plan``). The top level is an ``argparse`` parser with one
sub-parser per command; each command parses its own options (``kaisa
COMMAND --help``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

COMMANDS = {
    "demo": "benchmark suite: optimizers with and without KAISA, time to a target accuracy",
    "plan": "print the KAISA work plan and cost model for a model and a world size",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        raise _UsageError(f"{self.prog}: error: {message}")


class _UsageError(Exception):
    pass


def _parser() -> argparse.ArgumentParser:
    from kaisa import __version__

    parser = _Parser(
        prog="kaisa",
        description="K-FAC gradient preconditioning with KAISA's adaptable placement of work.",
        epilog="Run `kaisa COMMAND --help` for the options of a command.",
    )
    parser.add_argument("-V", "--version", action="version", version=f"kaisa {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, text in COMMANDS.items():
        # Each command parses its own options: everything after its name.
        commands.add_parser(name, help=text, description=text, add_help=False)
    return parser


def _demo(options: list[str]) -> int:
    try:
        from kaisa.demo.cli import main as demo_main
    except ModuleNotFoundError as error:
        if error.name is None or not error.name.startswith("kaisa."):
            raise
        print(
            "kaisa demo: the benchmark suite runs from a checkout of the kaisa repository "
            "(`make demo`, or `pip install -e '.[demo,bench]'` there); the installed "
            "package holds the library only",
            file=sys.stderr,
        )
        return 2
    return demo_main(options)


def _plan(options: list[str]) -> int:
    from kaisa.cli.plan import main as plan_main

    return plan_main(options)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kaisa`` console script; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if not args:
        parser.print_help(sys.stderr)
        return 2
    # The top level parses up to the command's name; the command, the rest.
    cut = next((i + 1 for i, arg in enumerate(args) if not arg.startswith("-")), len(args))
    try:
        parsed = parser.parse_args(args[:cut])
    except _UsageError as error:
        print(error, file=sys.stderr)
        return 2
    except SystemExit as exit_:  # --help, --version
        return exit_.code if isinstance(exit_.code, int) else 0
    if parsed.command is None:
        parser.print_help(sys.stderr)
        return 2
    return {"demo": _demo, "plan": _plan}[parsed.command](args[cut:])


if __name__ == "__main__":
    sys.exit(main())
