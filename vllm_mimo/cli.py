"""The `vllm-mimo` command: `vllm-mimo doctor` checks the host (see README 'Host tuning')."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from vllm_mimo import doctor


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-mimo", description="vllm-mimo tools.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    doctor_parser = commands.add_parser(
        "doctor",
        help="check the host settings that slow hybrid-SWA serving",
        description=doctor.DESCRIPTION,
        epilog=doctor.EPILOG,
    )
    doctor.add_arguments(doctor_parser)
    doctor_parser.set_defaults(run=doctor.run)
    args = parser.parse_args(argv)
    return args.run(args)
