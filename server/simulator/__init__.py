"""Simulate an SGLang server's HTTP API for tests and dry runs (never a real server).

It answers the native endpoints the fleet uses with SGLang 0.5.23's request and response shapes
(`contract`), makes up generations from a real tokenizer's vocabulary behind a cap on running requests
(`engine`), and serves them over HTTP with fault flags that make it crash, abort, fail or hang on purpose
(`app`). `python -m server simulate --help` lists its flags (`cli`).
"""

from server.simulator.cli import add_arguments, run

__all__ = ["add_arguments", "run"]
