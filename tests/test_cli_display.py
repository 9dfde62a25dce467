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
