"""(Shared with tests/trainer/test_recovery.py: the NaN-on-marked-rows loss and its data.)"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from tests.trainer.helpers import micro_model  # noqa: E402,F401
from tests.trainer.test_recovery import MARK, _dataset, nan_on_marked_rows  # noqa: E402,F401
