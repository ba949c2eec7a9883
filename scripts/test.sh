#!/usr/bin/env bash
# Quick start: run the test suite (it starts its own redis-server and simulators).
FLEET_EXTRAS=test source "$(dirname "$0")/setup.sh"
exec .venv/bin/python -m pytest "$@"
