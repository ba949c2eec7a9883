"""The simulator's command line: SGLang's own flag names where SGLang has the flag, fault flags beside them."""

from __future__ import annotations

import argparse
import logging

from common.settings import get_settings

log = logging.getLogger("server.simulator")


def fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not between 0 and 1")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="default: SGLang's 30000")
    parser.add_argument("--model-path", default="simulated-model", help="the name it reports, nothing is loaded")
    parser.add_argument("--served-model-name", help="default: --model-path")
    parser.add_argument(
        "--tokenizer-path",
        help="the tokenizer whose vocabulary, end token and chat-template markers it answers with"
        " (default: FLEET_TOKENIZER, as the producer renders prompts with)",
    )
    parser.add_argument("--api-key", help="require `Authorization: Bearer KEY`, as SGLang's --api-key does")
    parser.add_argument("--context-length", type=positive_int, default=32768)
    parser.add_argument("--min-output-tokens", type=int, default=16, help="shortest natural answer before EOS")
    parser.add_argument("--max-output-tokens", type=int, default=256, help="longest natural answer before EOS")
    parser.add_argument("--token-latency", type=float, default=0.002, help="seconds per generated token")
    parser.add_argument("--prefill-latency", type=float, default=0.0, help="seconds per 1000 prompt tokens")
    parser.add_argument(
        "--max-running",
        "--max-running-requests",
        dest="max_running",
        type=positive_int,
        default=256,
        help="requests running at once; later ones queue in arrival order",
    )
    parser.add_argument(
        "--max-total-tokens",
        type=positive_int,
        default=1 << 20,
        help="KV cache size reported and used for sglang:token_usage (it admits nothing)",
    )
    parser.add_argument("--seed", type=int, default=0, help="changes every output and the fault draws")
    faults = parser.add_argument_group("faults")
    faults.add_argument(
        "--exit-after", type=positive_int, help="die abruptly (os._exit) after answering this many /generate requests"
    )
    faults.add_argument(
        "--crash-on-token",
        type=int,
        metavar="ID",
        help="die abruptly (os._exit) as soon as a prompt holding this token id arrives, with all in flight",
    )
    faults.add_argument(
        "--abort-rate",
        type=fraction,
        default=0.0,
        help="fraction of prompts finished early with finish_reason abort (HTTP 200)",
    )
    faults.add_argument(
        "--error-rate", type=fraction, default=0.0, help="fraction of /generate turned away with --error-status"
    )
    faults.add_argument(
        "--error-status",
        type=int,
        choices=(408, 429, 502, 503, 504),
        default=503,
        help="503: SGLang refusing one request; 429, 408: a router's full or timed-out queue; 502, 504: a proxy",
    )
    faults.add_argument("--retry-after", type=float, help="seconds sent in a Retry-After header with each refusal")
    faults.add_argument("--hang", action="store_true", help="/generate and /health_generate never answer")


def run(args: argparse.Namespace) -> int:
    # The web stack and transformers load only when the simulator runs: `python -m server plan` needs neither.
    try:
        import uvicorn
    except ImportError:
        log.error("the simulator needs its web stack: pip install -e '.[simulator]'")
        return 2

    from server.simulator.app import Simulator
    from server.simulator.engine import Model, TokenizerError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not 0 <= args.min_output_tokens <= args.max_output_tokens:
        log.error("need 0 <= --min-output-tokens <= --max-output-tokens")
        return 2
    args.tokenizer_path = args.tokenizer_path or get_settings().tokenizer
    try:
        lengths = (args.min_output_tokens, args.max_output_tokens)
        model = Model(args.tokenizer_path, args.context_length, lengths, args.seed)
    except TokenizerError as error:
        log.error("%s", error)
        return 2
    simulator = Simulator(args, model)
    log.info(
        "SGLang SIMULATOR (not a real server, no model loaded) for %s, tokenizer %s, starting on http://%s:%d",
        simulator.model_name,
        args.tokenizer_path,
        args.host,
        args.port,
    )
    config = uvicorn.Config(
        simulator.app(),
        host=args.host,
        port=args.port,
        log_config=None,
        log_level="warning",
        access_log=False,
        timeout_keep_alive=5,
        timeout_graceful_shutdown=2,
    )
    uvicorn.Server(config).run()
    return 0
