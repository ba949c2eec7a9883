#!/usr/bin/env bash
# Quick start: run the whole pipeline on the bundled sample partitions against the SGLang simulator.
FLEET_EXTRAS=simulator source "$(dirname "$0")/setup.sh"
exec .venv/bin/python -m scripts.demo "$@"
