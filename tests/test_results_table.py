"""benchmarks/RESULTS.md opens with the table benchmarks/results_table.py writes from the log below
it: the table cannot go stale, writing it twice changes nothing, and the log is read by its rules
(a later run of a figure wins, quotes and an A/B's sides are not runs, each configuration its row)."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import results_table as rt  # noqa: E402


def _file(log: str) -> str:
    return f"# Benchmark results\n\nintro\n\n{rt.BEGIN}\n{rt.END}\n\n# The log\n{log}"


def _rows(text: str) -> list:
    table = rt.render(text).split(rt.BEGIN)[1].split(rt.END)[0].strip().splitlines()[2:]
    return [[c.strip() for c in row.strip("|").split(" | ")] for row in table]


LOG = """
Machine: two cores. Date: 2026-11-30.

## Engine (issue 2)

`python benchmarks/bench_engine.py --reps 3`:
```
RESULT engine_step_vs_plain 0.97 x (target <= 1.1)
main: RESULT engine_step_vs_plain 5.0 x (target <= 1.1)
RESULT engine_peak 176 MiB (target < 704)
```
Second session, same command: `RESULT engine_step_vs_plain 1.2 x (target <= 1.1)`; an older run
had printed `RESULT engine_peak 1`.

### Quiet machine, 2026-12-01

`PYTHONPATH=$PWD python -u benchmarks/bench_engine.py --dir /tmp/x
--reps 5`
```
RESULT engine_peak 170 MiB (target < 704)
```
`python benchmarks/bench_engine.py --codec int8`:
```
RESULT engine_peak 120 MiB (target < 704)
RESULT engine_info 3 s (from memory; info)
```
"""


def test_the_table_at_the_top_is_what_the_log_gives():
    text = rt.RESULTS.read_text()
    assert rt.render(text) == text, "benchmarks/RESULTS.md's table is stale: run python benchmarks/results_table.py"
    assert rt.main(["--check"]) == 0
    assert len(_rows(text)) >= 50   # every figure of the log, not an empty table


def test_writing_the_table_twice_changes_nothing(tmp_path):
    stale = tmp_path / "RESULTS.md"
    stale.write_text(_file(LOG))
    assert rt.main(["--check", "--file", str(stale)]) == 1
    assert rt.main(["--file", str(stale)]) == 0
    once = stale.read_text()
    assert rt.main(["--file", str(stale)]) == 0 and stale.read_text() == once
    assert rt.main(["--check", "--file", str(stale)]) == 0
    assert once.endswith(_file(LOG).split(rt.END)[1])   # the log below is kept as it was


def test_the_latest_run_of_each_figure_and_configuration_wins():
    rows = {(r[0], r[5]): r for r in _rows(_file(LOG))}
    assert rows[("`engine_step_vs_plain`", "`python benchmarks/bench_engine.py --reps 3`")][1:5] == \
        ["1.2 x", "<= 1.1", "no", "2026-11-30"]   # the prose's quoted run, not the A/B's "main:" side
    # the quiet run supersedes the first (only --dir/--reps/-u/PYTHONPATH differ) and dates itself
    assert rows[("`engine_peak`", "`PYTHONPATH=$PWD python -u benchmarks/bench_engine.py --dir /tmp/x --reps 5`")][1:5] \
        == ["170 MiB", "< 704", "yes", "2026-12-01"]
    assert rows[("`engine_peak`", "`python benchmarks/bench_engine.py --codec int8`")][1] == "120 MiB"
    assert rows[("`engine_info`", "`python benchmarks/bench_engine.py --codec int8`")][2:4] == \
        ["— (from memory; info)", ""]
    assert len(rows) == 4   # the quote without its target ("RESULT engine_peak 1") is not a run


def test_a_figure_without_its_command_is_refused_naming_it():
    log = "\n## Long context\n\n```\nRESULT long_ctx_growth 3.8 KiB/token (target <= 6)\n```\n"
    with pytest.raises(ValueError, match="long_ctx_growth under 'Long context' has no command"):
        rt.render(_file(log))


def test_a_file_without_its_markers_is_refused():
    with pytest.raises(ValueError, match="table markers"):
        rt.render("# Benchmark results\n\n## Engine\n")
