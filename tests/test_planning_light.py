"""Planning without torch (issue 43): the planner, the prediction, the rates, the plan picker and
the estimator import no torch (nor transformers), so ``mt.estimate``, ``megatrain-nb estimate`` and
``--help`` stay light. Checked in a fresh interpreter, whose sys.modules nothing else filled."""
from __future__ import annotations

import json
import subprocess
import sys

PLANNING = ("megatrain_nb.engine.planning.planner", "megatrain_nb.engine.planning.prediction", "megatrain_nb.engine.planning.rates",
            "megatrain_nb.engine.planning.best_plans", "megatrain_nb.engine.planning.plan_pick", "megatrain_nb.engine.planning.prediction_check",
            "megatrain_nb.engine.planning.rates_cache", "megatrain_nb.engine.family",
            "megatrain_nb.engine.planning.estimator", "megatrain_nb.engine.planning.estimator_dist", "megatrain_nb.engine.planning.estimator_dpo",
            "megatrain_nb.engine.planning.estimator_grpo",
            "megatrain_nb.estimate_words")


def _heavy_after(modules) -> dict:
    code = ("import importlib, json, sys\n"
            f"for m in {list(modules)!r}: importlib.import_module(m)\n"
            "print(json.dumps({k: k in sys.modules for k in ('torch', 'transformers')}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_planning_imports_no_torch():
    assert _heavy_after(PLANNING) == {"torch": False, "transformers": False}


def test_the_engine_package_loads_torch_only_for_the_engine():
    assert _heavy_after(["megatrain_nb.engine"]) == {"torch": False, "transformers": False}
    assert _heavy_after(["megatrain_nb.engine.engine"])["torch"] is True   # (the check can fail)
