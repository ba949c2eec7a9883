"""`python -m worker short long`: run a FleetWorker on the fleet's Redis."""

from __future__ import annotations

import argparse
import sys

from common.connection import RedisUnavailable, connect
from common.protocol.keys import QUEUES
from common.settings import get_settings
from worker.fleet import FleetWorker


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker", description=__doc__)
    parser.add_argument("queues", nargs="*", default=list(QUEUES), help="queues in priority order")
    parser.add_argument("--burst", action="store_true", help="exit once the queues are empty and nothing is in flight")
    parser.add_argument("--name", help="worker name (default: random)")
    parser.add_argument("--logging-level", default="INFO")
    args = parser.parse_args(argv)
    settings = get_settings()
    try:
        connection = connect(settings)
    except RedisUnavailable as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    worker = FleetWorker(args.queues, name=args.name, connection=connection)
    return 0 if worker.work(burst=args.burst, logging_level=args.logging_level) else 1


if __name__ == "__main__":
    sys.exit(main())
