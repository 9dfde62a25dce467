"""The table that opens benchmarks/RESULTS.md: the latest run of every RESULT figure, read from the
log below it. Run it after adding a run to the log; `--check` exits 1 when the table is not what
the log gives (tests/test_results_table.py does the same).

How the log is read:
- a run's figures are its RESULT lines as the script printed them, whole:
  `RESULT name value [unit] (target ...)`, at the start of a line inside a ``` block, or as one
  backticked span in the prose (a later run quoted in a sentence). A figure quoted without its
  parenthesis (an older value mentioned in passing) and a line with something before `RESULT`
  (`main: RESULT ...`, an A/B's side) are not runs;
- its command is the last backticked `... benchmarks/<script>.py ...` before it in its section
  (a heading starts a section; a RESULT with no command before it is an error);
- its date is the last YYYY-MM-DD before it: in the prose of its section, else in its heading,
  else in the enclosing section's, else in the log's opening paragraph;
- a figure's rows: one per configuration (the command without the arguments that only say where
  or how often: the interpreter and its `-u`, environment settings, `timeout N`, `--dir`, `--reps`,
  `--steps`), the latest in the log winning: the log is appended to in time order.

    python benchmarks/results_table.py            # rewrites the table in benchmarks/RESULTS.md
    python benchmarks/results_table.py --check    # exit 1 when it is stale
"""
from __future__ import annotations

import argparse
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
BEGIN = "<!-- results table: written by benchmarks/results_table.py from the log below; do not edit by hand -->"
END = "<!-- end of the results table -->"

_RESULT = re.compile(r"RESULT (\S+) (\S+) *([^(]*?) *\((.*)\)\s*$")
_DATE = re.compile(r"\b(20\d\d-\d\d-\d\d)\b")
_SPAN = re.compile(r"`([^`]+)`")
_HEADING = re.compile(r"^(#+) (.*)$")
_COMMAND = re.compile(r"benchmarks/\w+\.py")
_OP = re.compile(r"^(<=|>=|==|<|>|=)\s*([-+0-9.eE]+)$")
# Arguments that say where or how often, not what is measured.
_NOT_CONFIG = {"--dir": 1, "--reps": 1, "--steps": 1, "-u": 0}


@dataclass(frozen=True)
class Run:
    """One RESULT figure as one run printed it, with where the log says it came from."""
    name: str
    value: str
    unit: str
    paren: str
    date: str
    command: str

    @property
    def config(self) -> str:
        """The command less the interpreter, environment, timeouts, paths and repetitions."""
        try:
            words = shlex.split(self.command)
        except ValueError:
            words = self.command.split()
        out, skip = [], 0
        for i, w in enumerate(words):
            if skip:
                skip -= 1
            elif re.match(r"^\w+=", w) or w in ("python", "python3"):
                continue
            elif w == "timeout":
                skip = 1
            elif w.split("=")[0] in _NOT_CONFIG:
                skip = 0 if "=" in w else _NOT_CONFIG[w.split("=")[0]]
            else:
                out.append(w)
        return " ".join(out)

    @property
    def target(self) -> str:
        if not self.paren.startswith("target"):
            return f"— ({self.paren})"
        return self.paren[len("target"):].split(";")[0].strip()

    @property
    def met(self) -> str:
        m = _OP.match(self.target)
        try:
            value, bound = float(self.value), float(m.group(2)) if m else None
        except ValueError:
            return ""
        if bound is None:
            return ""
        ok = {"<=": value <= bound, ">=": value >= bound, "<": value < bound, ">": value > bound,
              "==": value == bound, "=": value == bound}[m.group(1)]
        return "yes" if ok else "no"


def split(text: str) -> tuple[str, str]:
    """(what precedes the table, the log after it); the file must hold both markers."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"{RESULTS.name} has lost its table markers: put {BEGIN!r} and {END!r} back "
                         "above the log")
    head, rest = text.split(BEGIN, 1)
    return head, rest.split(END, 1)[1]


def _parse(result_text: str, date: str, command: str | None, where: str) -> Run | None:
    m = _RESULT.match(result_text.strip())
    if not m:
        return None
    if command is None:
        raise ValueError(f"the log's RESULT {m.group(1)} {where} has no command before it in its section: "
                         "write the command that printed it, in backticks, above its block")
    return Run(m.group(1), m.group(2), m.group(3), m.group(4), date, command)


def runs(log: str) -> list[Run]:
    """Every run's figure in the log, in log order."""
    dates = {1: None}           # heading level -> the date in force there
    level, command, out, heading = 1, None, [], "the log's opening"
    fence = False
    for line in log.splitlines():
        if line.startswith("```"):
            fence = not fence
            continue
        h = None if fence else _HEADING.match(line)
        if h:
            level, command, heading = len(h.group(1)), None, h.group(2)
            inherited = next((dates[k] for k in sorted(dates, reverse=True) if k < level and dates[k]), None)
            found = _DATE.findall(h.group(2))
            dates = {k: v for k, v in dates.items() if k < level}
            dates[level] = found[-1] if found else inherited
            continue
        where = f"under {heading!r}"
        if fence:
            if line.startswith("RESULT "):
                out.append(_parse(line, dates.get(level), command, where))
            continue
        # prose: dates, commands and quoted RESULT lines, in the order they are written
        events = [(m.start(), "date", m.group(1)) for m in _DATE.finditer(line)]
        events += [(m.start(), "span", m.group(1)) for m in _SPAN.finditer(line)]
        for _, kind, value in sorted(events):
            if kind == "date":
                dates[level] = value
            elif _COMMAND.search(value) and not value.startswith("RESULT"):
                command = " ".join(value.split())
            elif value.startswith("RESULT "):
                run = _parse(value, dates.get(level), command, where)
                if run:
                    out.append(run)
    return [r for r in out if r]


def _join_spans(log: str) -> str:
    """Backticked spans that wrap onto the next line, joined onto one line (commands often wrap)."""
    out, fence = [], False
    for line in log.splitlines():
        if line.startswith("```"):
            fence = not fence
        if out and not fence and not line.startswith("```") and out[-1].count("`") % 2 == 1 \
                and not out[-1].startswith("```") and line.strip():
            out[-1] += " " + line
        else:
            out.append(line)
    return "\n".join(out)


def table(log: str) -> str:
    """The markdown table of the latest run of each figure and configuration."""
    latest: dict[tuple[str, str], Run] = {}
    for run in runs(_join_spans(log)):
        latest[(run.name, run.config)] = run
    rows = ["| figure | value | target | met | date | command |", "|---|---|---|---|---|---|"]
    for key in sorted(latest):
        r = latest[key]
        cells = [f"`{r.name}`", f"{r.value} {r.unit}".strip(), r.target, r.met, r.date or "", f"`{r.command}`"]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


def render(text: str) -> str:
    """The whole file with its table written from its log."""
    head, log = split(text)
    return f"{head}{BEGIN}\n{table(log)}\n{END}{log}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the table is not what the log gives")
    ap.add_argument("--file", type=Path, default=RESULTS)
    ns = ap.parse_args(argv)
    text = ns.file.read_text()
    new = render(text)
    if ns.check:
        if new != text:
            print(f"{ns.file}: the results table is stale; run python benchmarks/results_table.py", file=sys.stderr)
            return 1
        return 0
    if new != text:
        tmp = ns.file.with_name(ns.file.name + ".tmp")
        tmp.write_text(new)
        tmp.replace(ns.file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
