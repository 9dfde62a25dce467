"""How this test session's engines choose their plans: by the planner's rules (the suite's default,
MEGATRAIN_NB_PLAN_BY=rules), or -- in scripts/test.sh's second pass, MEGATRAIN_NB_TEST_RATES set --
by the machine's measured rates, as a user's engines do once `megatrain-nb machine` has run. The
engine's memory and parity tests run both ways (issue 45: the device working set stays flat in
depth and the results exact whichever way the plan was made); this test says which way this session
went, so that the second pass cannot silently fall back to the rules."""
import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine


def test_the_sessions_engines_plan_the_way_the_pass_says():
    cfg = AutoConfig.for_model("llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=64)
    engine = StreamingEngine(AutoModelForCausalLM.from_config(cfg), EngineConfig(device="cpu"))
    try:
        engine.forward_backward(torch.randint(0, 256, (1, 16)))
        why = engine.plan.chosen_by
    finally:
        engine.close()
    if os.environ.get("MEGATRAIN_NB_TEST_RATES"):
        assert "MEGATRAIN_NB_PLAN_BY=rules" not in why.split(";")[0] and "no measured rates" not in why, why
        assert "rates: measured" in why, why
    else:
        assert why.startswith("rules: MEGATRAIN_NB_PLAN_BY=rules"), why
