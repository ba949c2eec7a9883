"""`python -m producer`: enqueue partitions, export the dataset."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common.connection import RedisUnavailable, connect
from common.settings import get_settings
from common.store import OutputStore
from producer.enqueue import Enqueuer, PartitionSummary
from producer.export import export_partition
from producer.partitions import PartitionError, load_partitions
from producer.tokenizer import ChatTokenizer


def enqueue(args: argparse.Namespace) -> int:
    settings = get_settings()
    partitions = load_partitions(settings.data_dir, args.partition)
    enqueuer = Enqueuer(
        connect(settings), settings, ChatTokenizer(settings.tokenizer), OutputStore(settings.samples_dir)
    )
    columns = ("partition", "total", "done", "queued/running", "failed", "enqueued", "rejected")
    print(_row(columns))
    summaries: list[PartitionSummary] = []
    for partition in partitions:
        summary = enqueuer.enqueue(partition)
        summaries.append(summary)
        print(
            _row(
                (
                    summary.partition,
                    summary.total,
                    summary.done,
                    summary.pending,
                    summary.failed,
                    summary.enqueued,
                    summary.rejected,
                )
            )
        )
        for reject in summary.rejects[: args.show_rejects]:
            print(f"  rejected {reject}")
        if len(summary.rejects) > args.show_rejects:
            print(f"  ... {len(summary.rejects) - args.show_rejects} more in {settings.rejects_dir}")
    return 0


def export(args: argparse.Namespace) -> int:
    settings = get_settings()
    store = OutputStore(settings.samples_dir)
    incomplete = False
    for partition in load_partitions(settings.data_dir, args.partition):
        summary = export_partition(settings, store, partition, args.out)
        line = f"{partition.name}: {summary.exported} records -> {summary.path}"
        if summary.missing:
            incomplete = True
            shown = ", ".join(map(str, summary.missing[:10]))
            more = f" and {len(summary.missing) - 10} more" if len(summary.missing) > 10 else ""
            line += f"; {len(summary.missing)} missing: {shown}{more}"
        if summary.rejected:
            line += f"; {summary.rejected} rejected at enqueue"
        print(line)
    return 1 if incomplete and args.strict else 0


def _row(cells: tuple[object, ...]) -> str:
    first, *rest = cells
    return f"{first!s:<24}" + "".join(f"{cell!s:>16}" for cell in rest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m producer")
    commands = parser.add_subparsers(dest="command", required=True)

    command = commands.add_parser("enqueue", help="enqueue every pending prompt of the partitions")
    command.add_argument("--partition", nargs="+", default=["all"], help="partition names, or all")
    command.add_argument("--show-rejects", type=int, default=5, metavar="N", help="rejects to print per partition")
    command.set_defaults(run=enqueue)

    command = commands.add_parser("export", help="write DIR/<partition>.jsonl from the committed outputs")
    command.add_argument("--partition", nargs="+", default=["all"], help="partition names, or all")
    command.add_argument("--out", type=Path, required=True, help="output directory")
    command.add_argument("--strict", action="store_true", help="exit 1 when any accepted prompt has no output")
    command.set_defaults(run=export)

    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (PartitionError, RedisUnavailable) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
