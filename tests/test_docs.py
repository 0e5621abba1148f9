"""docs/configuration.md is generated from verl_tasks/config.py: it must match what the script writes now."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_is_current():
    reason = load_script().check(ROOT / "docs" / "configuration.md")
    assert reason is None, reason


def test_check_names_a_stale_line(tmp_path):
    script = load_script()
    stale = tmp_path / "configuration.md"
    stale.write_text(script.render().replace("| `algorithm.lr` |", "| `algorithm.learning_rate` |"))
    reason = script.check(stale)
    assert reason and "stale at line" in reason and "make docs" in reason
    assert script.main(["--check", "--out", str(stale)]) == 1
    stale.write_text(script.render())
    assert script.main(["--check", "--out", str(stale)]) == 0
