"""`python -m server COMMAND`: each command lives in its own module with `add_arguments` and `run`."""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "simulate": "server.simulator",
    "plan": "server.plan",
    "launch": "server.launch",
    "supervise": "server.supervise",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m server")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        module.add_arguments(subparsers.add_parser(name, help=module.__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    module = importlib.import_module(COMMANDS[args.command])
    return module.run(args)


if __name__ == "__main__":
    sys.exit(main())
