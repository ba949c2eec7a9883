"""`python -m producer`: enqueue partitions, watch the run, retry or cancel jobs, export and verify the dataset."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

import orjson
import redis

from common.connection import RedisUnavailable, connect
from common.settings import Settings, get_settings
from common.store import OutputStore, StoreError, open_store
from producer.dataset.formats import FORMATS
from producer.errors import SetupError, writable_directory
from producer.partitions import Partition, PartitionError, check_known, load_partitions, stray_files
from producer.wording import plural

# Commands that tokenize import transformers (a second or two) when they run, so that status,
# retry-failed and cancel answer at once.


def enqueue(args: argparse.Namespace) -> int:
    from producer.enqueue import Enqueuer, PartitionSummary
    from producer.rejects import report_key
    from producer.tokenizer import ChatTokenizer

    settings = get_settings()
    partitions = _partitions(settings, args.partition)
    # The rejects report is written after a partition's jobs are pushed: a bad directory must stop us first.
    store = writable_store(settings)
    enqueuer = Enqueuer(connect(settings), settings, ChatTokenizer(settings.tokenizer), store)
    # The state after enqueueing: `queued/running` counts the jobs queued now and those found already queued.
    columns = ("partition", "total", "done", "queued/running", "failed", "rejected", "enqueued now")
    if not args.json:
        print(_row(columns))
    summaries: list[PartitionSummary] = []
    for partition in partitions:
        summary = enqueuer.enqueue(partition)
        summaries.append(summary)
        if args.json:
            continue
        print(
            _row(
                (
                    summary.partition,
                    summary.total,
                    summary.done,
                    summary.pending + summary.enqueued,
                    summary.failed,
                    summary.rejected,
                    summary.enqueued,
                )
            )
        )
        if summary.changed:
            edited = plural(summary.changed, "prompt")
            print(f"  changed: {edited} edited since their outputs were made, generated again")
        if summary.superseded:
            failed = plural(summary.superseded, "failed job")
            print(f"  superseded: {failed} of earlier versions of edited prompts deleted")
        if summary.total == 0:
            print(f"  empty: no records in {settings.data_dir / summary.partition}.jsonl")
        for reject in summary.rejects[: args.show_rejects]:
            print(f"  rejected {reject}")
        if len(summary.rejects) > args.show_rejects:
            report = f"{store.location}/{report_key(summary.partition)}"
            print(f"  ... {len(summary.rejects) - args.show_rejects} more in {report}")
    if args.json:
        _print_json({"partitions": {summary.partition: summary.to_json() for summary in summaries}})
    return 0


def status(args: argparse.Namespace) -> int:
    from producer.console.screen import render
    from producer.console.status import collect_status

    settings = get_settings()
    connection = connect(settings)
    store = open_store(settings)
    recount = args.recount
    while True:
        snapshot = collect_status(connection, settings, store, recount)
        recount = False
        if args.json:
            output = orjson.dumps(snapshot.to_json(), option=orjson.OPT_INDENT_2).decode()
        else:
            output = render(snapshot)
        if args.watch is None:
            print(output)
            return 0
        # Home, clear to the end, redraw: the screen refreshes in place.
        sys.stdout.write("\x1b[H\x1b[J" + output + "\n")
        sys.stdout.flush()
        time.sleep(args.watch)


def retry_failed(args: argparse.Namespace) -> int:
    from producer.console.census import recorded_partitions
    from producer.console.retry import retry_failed as retry

    settings = get_settings()
    connection = connect(settings)
    _check_known(settings, args.partition or [], recorded_partitions(connection))
    summary = retry(connection, open_store(settings), args.partition, args.cause)
    if args.json:
        _print_json(asdict(summary))
        return 0
    per_partition = ", ".join(f"{name}: {count}" for name, count in sorted(summary.retried.items()))
    requeued = plural(summary.retried.total(), "failed job")
    print(f"requeued {requeued}" + (f" ({per_partition})" if per_partition else ""))
    if summary.already_done:
        print(f"deleted {plural(summary.already_done, 'failed job')} whose sample was committed meanwhile")
    if summary.gone:
        entries = plural(summary.gone, "failed-registry entry", "failed-registry entries")
        print(f"dropped {entries} whose job had expired from Redis")
    if summary.left:
        print(f"left {plural(summary.left, 'failed job')} that --partition or --cause did not select")
    return 0


def cancel(args: argparse.Namespace) -> int:
    from producer.console.cancel import cancel_queued
    from producer.console.census import PartitionResolver, recorded_partitions, take_census

    settings = get_settings()
    connection = connect(settings)
    _check_known(settings, args.partition, recorded_partitions(connection))
    canceled = cancel_queued(connection, args.partition)
    seconds, _ = connection.time()
    # Every recorded partition, not only the canceled ones: a job of `p--x` must not count as one of `p`'s.
    resolver = PartitionResolver(connection, set(recorded_partitions(connection)) | set(args.partition))
    census = take_census(connection, resolver, seconds, 0, settings.result_ttl)
    if args.json:
        in_flight = {name: len(census.in_flight[name]) for name in args.partition}
        _print_json({"canceled": {name: canceled[name] for name in args.partition}, "in_flight": in_flight})
        return 0
    for name in args.partition:
        print(
            f"{name}: canceled {plural(canceled[name], 'queued job')};"
            f" {len(census.in_flight[name])} in flight will finish"
            f" (`python -m producer enqueue --partition {name}` queues the rest again)"
        )
    return 0


def export(args: argparse.Namespace) -> int:
    from producer.dataset.export import export_partition
    from producer.dataset.formats import ExportOptions
    from producer.dataset.manifest import write_manifest
    from producer.tokenizer import ChatTokenizer

    settings = get_settings()
    partitions = _partitions(settings, args.partition)
    tokenizer = ChatTokenizer(settings.tokenizer)
    writable_directory(args.out, "export --out")
    store = open_store(settings)
    options = ExportOptions(args.format, args.include_truncated, args.split_reasoning)
    incomplete = False
    summaries = []
    for partition in partitions:
        summary = export_partition(settings, store, partition, args.out, options, tokenizer)
        summaries.append(summary)
        line = f"{partition.name}: {summary.exported} records -> {summary.path}"
        if summary.missing:
            incomplete = True
            shown = ", ".join(map(str, summary.missing[:10]))
            more = f" and {len(summary.missing) - 10} more" if len(summary.missing) > 10 else ""
            line += f"; {len(summary.missing)} missing: {shown}{more}"
        if summary.truncated and not options.keeps_truncated:
            line += f"; {summary.truncated} cut at max_new_tokens left out (--include-truncated keeps them)"
        if summary.skipped:
            line += (
                f"; {summary.skipped} input_ids-only prompts skipped (no turns to show; --format specforge has them)"
            )
        if summary.drifted:
            line += f"; {summary.drifted} do not tokenize back into the generated ids (--format specforge is exact)"
        if summary.rejected:
            line += f"; {summary.rejected} rejected at enqueue"
        print(line)
    tokenizer_info = {"name": tokenizer.name, "sha256": tokenizer.digest()}
    print(f"manifest -> {write_manifest(args.out, options, tokenizer_info, summaries)}")
    if options.format == "specforge":
        longest = max((summary.longest for summary in summaries), default=0)
        print(
            f"for SpecForge: `cat {args.out}/*.jsonl > train.jsonl`, then data.prompts_path=train.jsonl"
            f" and data.max_length >= {longest} (the longest record)"
        )
    return 1 if incomplete and args.strict else 0


def verify(args: argparse.Namespace) -> int:
    from producer.dataset.verify import Verifier
    from producer.tokenizer import ChatTokenizer

    settings = get_settings()
    store = open_store(settings)
    partitions = _partitions(settings, args.partition)
    verifier = Verifier(settings, store, ChatTokenizer(settings.tokenizer), args.export, args.show)
    for partition in partitions:
        verifier.partition(partition)
    if args.partition == ["all"]:
        for name in sorted(set(store.partitions()) - {partition.name for partition in partitions}):
            verifier.foreign(name)
    print(verifier.report.render(len(partitions)))
    return 1 if verifier.report.problems else 0


def writable_store(settings: Settings) -> OutputStore:
    """The output store, proven writable before any work: enqueue writes its rejects report last."""
    store = open_store(settings)
    problem = store.problem()
    if problem:
        raise SetupError(f"FLEET_OUTPUT_DIR: {problem}")
    return store


def _partitions(settings: Settings, names: list[str]) -> list[Partition]:
    """The partitions named, with a word on any file in the data directory that is not one."""
    partitions = load_partitions(settings.data_dir, names)
    if stray := stray_files(settings.data_dir):
        print(f"note: skipped {', '.join(stray)} in {settings.data_dir}: a partition is NAME.jsonl", file=sys.stderr)
    return partitions


def _check_known(settings: Settings, names: list[str], recorded: Iterable[str]) -> None:
    """Partitions named on the command line must exist: in the data directory, or enqueued before."""
    files = {path.stem for path in settings.data_dir.glob("*.jsonl")} if settings.data_dir.is_dir() else set()
    check_known(names, files | set(recorded), settings.data_dir)


def _print_json(value: object) -> None:
    print(orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode())


def _row(cells: tuple[object, ...]) -> str:
    first, *rest = cells
    return f"{first!s:<24}" + "".join(f"{cell!s:>16}" for cell in rest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m producer")
    commands = parser.add_subparsers(dest="command", required=True)
    partitions = {"nargs": "+", "default": ["all"], "help": "partition names, or all"}

    command = commands.add_parser("enqueue", help="enqueue every pending prompt of the partitions")
    command.add_argument("--partition", **partitions)
    command.add_argument("--show-rejects", type=int, default=5, metavar="N", help="rejects to print per partition")
    command.add_argument("--json", action="store_true", help="print one JSON object instead")
    command.set_defaults(run=enqueue)

    command = commands.add_parser("status", help="progress, throughput, workers, servers and failures at a glance")
    command.add_argument("--json", action="store_true", help="print one JSON object instead")
    command.add_argument(
        "--watch", type=float, nargs="?", const=5.0, metavar="SECONDS", help="refresh in place (every 5 s)"
    )
    command.add_argument(
        "--recount", action="store_true", help="count done samples in the output store again (exact when workers idle)"
    )
    command.set_defaults(run=status)

    command = commands.add_parser("retry-failed", help="put failed jobs back in their queues")
    command.add_argument("--partition", nargs="+", help="only these partitions")
    command.add_argument("--cause", help="only failures whose cause or message contains this text")
    command.add_argument("--json", action="store_true", help="print one JSON object instead")
    command.set_defaults(run=retry_failed)

    command = commands.add_parser("cancel", help="remove a partition's queued jobs; jobs in flight finish")
    command.add_argument("--partition", nargs="+", required=True, help="partition names")
    command.add_argument("--json", action="store_true", help="print one JSON object instead")
    command.set_defaults(run=cancel)

    command = commands.add_parser("export", help="write DIR/<partition>.jsonl and DIR/manifest.json")
    command.add_argument("--partition", **partitions)
    command.add_argument("--out", type=Path, required=True, help="output directory")
    command.add_argument(
        "--format",
        choices=FORMATS,
        default="specforge",
        help="specforge: token ids and loss mask, exactly as generated (default); text: decoded, for SpecForge's"
        " is_preformatted; sharegpt: conversations; raw: the records as committed",
    )
    command.add_argument(
        "--include-truncated", action="store_true", help="keep generations cut at max_new_tokens (left out by default)"
    )
    command.add_argument(
        "--split-reasoning",
        action="store_true",
        help="sharegpt: reasoning and tool calls in their own fields, for SpecForge's thinking parsers",
    )
    command.add_argument("--strict", action="store_true", help="exit 1 when any accepted prompt has no output")
    command.set_defaults(run=export)

    command = commands.add_parser("verify", help="check the outputs (and an export) against the partitions")
    command.add_argument("--partition", **partitions)
    command.add_argument("--export", type=Path, metavar="DIR", help="also check the export in DIR")
    command.add_argument("--show", type=int, default=20, metavar="N", help="findings to print per kind")
    command.set_defaults(run=verify)

    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (PartitionError, SetupError, RedisUnavailable, StoreError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except redis.ConnectionError as error:
        print(f"error: lost Redis: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
