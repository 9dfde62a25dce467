"""What a run will cost before it runs, without torch (tests/test_planning_light.py): the planner
(budgets -> placement and schedule, refused with numbers when nothing fits), the plan picker (the
fastest feasible plan by prediction, never against what the user set), the step-time prediction
and its check against the measurement, and the machine's rates (their cache read and checked
here; measured by engine/measure.py, which needs torch).
"""
