"""A saved model folder's files share one mode (issue 46 item 8: model.safetensors was written
0600 by safetensors while config.json and the rest were 0644, umask applied)."""
import os

from transformers import AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.model_configs import family_config


def test_save_pretrained_writes_every_file_with_the_same_mode(tmp_path):
    old = os.umask(0o022)
    try:
        eng = StreamingEngine(AutoModelForCausalLM.from_config(family_config("llama", layers=1)),
                              EngineConfig(device="cpu"))
        eng.save_pretrained(tmp_path / "out")
        eng.close()
    finally:
        os.umask(old)
    modes = {f.name: oct(f.stat().st_mode & 0o777) for f in (tmp_path / "out").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == "0o644", modes
