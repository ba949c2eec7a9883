"""`python -m server.logpipe LOG -- COMMAND...`: run COMMAND with its output appended to LOG, the API key masked.

SGLang logs its server arguments, `api_key` included, when it starts. This wrapper sits between the
server and its log file so that the key never reaches the file. It is the leader of the server's process
group (server/process.py), outlives a SIGTERM sent to the group long enough to log the server's last words,
and exits with the server's exit code.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import BinaryIO

from common.settings import get_settings

MASK = b"***"
# After the server exits, how long to keep copying output its children may still be writing.
DRAIN_SECONDS = 5.0


def copy(source: BinaryIO, log: BinaryIO, secrets: list[bytes]) -> None:
    for line in iter(source.readline, b""):
        for secret in secrets:
            line = line.replace(secret, MASK)
        log.write(line)
        log.flush()


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    log_path, command = Path(argv[0]), argv[2:]
    key = get_settings().sglang_api_key
    secrets = [key.get_secret_value().encode()] if key and key.get_secret_value() else []
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        try:
            server = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
        except OSError as error:
            log.write(f"logpipe: cannot start {command[0]}: {error}\n".encode())
            return 127
        # Set after the start: ignored signals are inherited, and the server must still get SIGTERM.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        assert server.stdout is not None
        copier = threading.Thread(target=copy, args=(server.stdout, log, secrets), daemon=True)
        copier.start()
        code = server.wait()
        # TP ranks that outlive the server keep the pipe open; the supervisor kills them with the group.
        copier.join(DRAIN_SECONDS)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
