#!/usr/bin/env bash
# Launch the two-rank ZeRO-3 flow N times (default 30) and count the launches that fail or abort
# at exit ("terminate called without an active exception"; issue 33). Slow: ~10 s a launch.
#   bash scripts/loop_two_ranks.sh 30
set -u
cd "$(dirname "$0")/.."
export MEGATRAIN_NB_LAUNCH_LOOPS="${1:-30}"
exec python -m pytest -q -p no:cacheprovider -m slow \
  "tests/distributed/test_zero3_flow.py::test_two_rank_launches_exit_cleanly_in_a_loop"
