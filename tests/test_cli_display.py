"""What the command line shows (issue 36): help without importing torch, whole reasons."""
import subprocess
import sys


def test_help_imports_neither_torch_nor_transformers():
    code = ("import sys\nfrom megatrain_nb.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\nprint('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "HEAVY []" in out.stdout, out.stdout[-500:] + out.stderr[-2000:]
    assert "estimate" in out.stdout and "train" in out.stdout


def test_codec_and_preset_names_still_show_and_check(capsys):
    import pytest

    from megatrain_nb.cli import main

    with pytest.raises(SystemExit):
        main(["estimate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "optimizer-state codec: none, int8, int4" in text and "a preset (micro, tiny" in text
    with pytest.raises(SystemExit) as e:
        main(["demo", "--compression", "int3"])
    assert e.value.code == 2 and "invalid choice: 'int3'" in capsys.readouterr().err


def test_models_prints_whole_reasons_wrapped_at_words():
    from megatrain_nb.sweep.table import REASON_WIDTH, text

    reason = "DoryForCausalLM calls its layer 1 more than once in one forward (a looped or shared layer); " * 3
    out = text([{"model_type": "dory", "status": "refused", "reason": reason},
                {"model_type": "llama", "status": "supported", "reason": None}], "4.x")
    lines = out.splitlines()
    assert all(len(line) <= REASON_WIDTH for line in lines)
    joined = " ".join(" ".join(line.split()) for line in lines[1:])
    assert " ".join(reason.split()) in joined   # nothing cut, no word split


def test_sft_without_trl_is_one_line_and_exit_2(tmp_path):
    code = ("import sys\nsys.modules['trl'] = None   # as if TRL were not installed\n"
            "from megatrain_nb.cli import main\nsys.exit(main(['train', '--config', sys.argv[1], '--output-dir', "
            "sys.argv[2]]))")
    import os

    config = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples", "sft.yaml")
    out = subprocess.run([sys.executable, "-c", code, config, str(tmp_path / "o")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megatrain-nb train: error: fine-tuning on conversations needs TRL")
    assert 'pip install "megatrain-nb[sft]"' in lines[0]


SFT_QUIET = """
import sys, warnings
warnings.simplefilter("default")
import megatrain_nb as mt
from transformers import AutoModelForCausalLM
from trl import SFTConfig
from megatrain_nb.assets import chat_dataset, chat_tokenizer
from megatrain_nb.model_configs import preset_config
import datasets
tok = chat_tokenizer()
model = AutoModelForCausalLM.from_config(preset_config("micro", vocab_size=len(tok)))
args = SFTConfig(output_dir=sys.argv[1], max_length=64, packing=True, bf16=False, max_steps=1, report_to="none",
                 assistant_only_loss=True, save_strategy="no")
t = mt.SFTTrainer(model=model, processing_class=tok, train_dataset=chat_dataset(n=40), eval_dataset=chat_dataset(n=8),
                  args=args)
t.close()
print("BARS", not datasets.are_progress_bars_disabled())
"""


def test_preparing_sft_data_shows_no_map_bars_and_no_gradient_checkpointing_warning(tmp_path):
    out = subprocess.run([sys.executable, "-c", SFT_QUIET, str(tmp_path / "o")], capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Map" not in out.stderr and "gradient_checkpointing" not in out.stderr, out.stderr[-2000:]
    assert "BARS True" in out.stdout   # switched off while preparing only


README_SFT = """
import re, sys
text = open(sys.argv[1]).read().split("## Fine-tuning on conversations", 1)[1]
code = re.search(r"```python\\n(.*?)```", text, re.S).group(1).replace("session.train()", "session.train(block=True)")
import os; os.chdir(sys.argv[2])
import megatrain_nb as mt
exec(code)
h = [r["loss"] for r in session.history if r.get("loss") is not None]
print("LOSSES", h[0], h[-1], session.step)
session.close()
"""


def test_the_readme_sft_snippet_visibly_learns(tmp_path):
    """The SFT snippet of docs/TRAINING.md (moved there from the README), run as written."""
    import os

    page = os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", "TRAINING.md")
    out = subprocess.run([sys.executable, "-c", README_SFT, page, str(tmp_path)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    first, last, step = next(l for l in out.stdout.splitlines() if l.startswith("LOSSES")).split()[1:]
    assert float(last) < 0.5 * float(first), (first, last, step)
