"""The ``kaisa`` command: a thin dispatcher to the sub-commands.

``kaisa demo ...`` runs the time-to-accuracy benchmark suite (``kaisa.demo``) and
``kaisa plan ...`` prints the KAISA work plan and cost model
(``kaisa.cli.plan``). Each sub-command owns its own options.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

_USAGE = """usage: kaisa {demo,plan} [options] | kaisa --version

  demo   benchmark suite: optimizers with and without KAISA, time to a target accuracy
  plan   print the KAISA work plan and cost model for a model and a world size

Run `kaisa COMMAND --help` for the options of a command."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kaisa`` console script; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        from kaisa import __version__

        print(f"kaisa {__version__}")
        return 0
    command, rest = args[0], args[1:]
    if command == "demo":
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
        return demo_main(rest)
    if command == "plan":
        from kaisa.cli.plan import main as plan_main

        return plan_main(rest)
    print(
        f"kaisa: unknown command {command!r}; expected 'demo' or 'plan'\n\n{_USAGE}",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
