"""The `vllm-mimo` command: `vllm-mimo doctor` checks the host and the install (see README 'Host
tuning'); `vllm-mimo events ENDPOINT` prints an engine's KV cache events (README 'KV cache events')."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from vllm_mimo import doctor, subscriber

# Each command's module has DESCRIPTION, EPILOG, add_arguments(parser) and run(args) -> exit status.
COMMANDS = {
    "doctor": (doctor, "check the host settings that slow hybrid-SWA serving, and the install"),
    "events": (subscriber, "print an engine's KV cache events, one JSON line per event"),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-mimo", description="vllm-mimo tools.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help) in COMMANDS.items():
        command = commands.add_parser(name, help=help, description=module.DESCRIPTION, epilog=module.EPILOG)
        module.add_arguments(command)
        command.set_defaults(run=module.run)
    args = parser.parse_args(argv)
    return args.run(args)
