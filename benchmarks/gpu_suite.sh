#!/usr/bin/env bash
# The one-command GPU suite (benchmarks/gpu_suite.py says what each stage checks):
#
#   bash benchmarks/gpu_suite.sh OUTDIR [--dry] [--wheelhouse DIR] [--budget-s S]
#
# OUTDIR gets summary.json (every stage's status and figures, rewritten after each stage) and
# suite.log. --wheelhouse installs the project from a folder of wheels first, with no index and
# the site's torch left in place (docs/install.md). --dry: tiny sizes, every stage that can run on
# CPU (CI runs it). How to run it on the lent GPU machine: docs/gpu_suite.md.
# Exit status: 0 when no stage failed, 1 otherwise; 2 for bad arguments.
set -uo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" benchmarks/gpu_suite.py "$@"
