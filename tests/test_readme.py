"""README's two top commands are what CI runs, exactly (issue 35)."""

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / ".ci"))
from readme_commands import readme_commands  # noqa: E402


def test_readme_top_holds_the_two_commands_ci_runs():
    install_and_demo, tests = readme_commands(ROOT / "README.md")
    # a fresh venv from the system's python3, pip upgraded inside the command, then the demo
    assert install_and_demo.startswith("python3 -m venv .venv && .venv/bin/pip install -q -U pip && "), install_and_demo
    assert install_and_demo.endswith(".venv/bin/python -m resformer_jax.main"), install_and_demo
    # the tests install what they need beyond the first command, then run the suite
    want = r"\.venv/bin/pip install -q -e '\.\[test\]' && \.venv/bin/python -m pytest -q -n 2 tests"
    assert re.fullmatch(want, tests), tests


def test_ci_runs_readme_commands_first_and_nothing_of_its_own_before_them():
    script = (ROOT / ".ci" / "run").read_text()
    steps = [ln.strip() for ln in script.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    first = next(i for i, ln in enumerate(steps) if 'README_COMMANDS[0]}"' in ln and ln.startswith("bash"))
    before = steps[:first]
    assert any("readme_commands.py" in ln for ln in before), "CI must read the commands from README"
    assert not [ln for ln in before if re.search(r"\bpip3?\b|\bvenv\b|\bpython3?\b.*-m", ln)], (
        f"CI sets up something before README's command: {before}"
    )
    assert any(ln.startswith("bash") and 'README_COMMANDS[1]}"' in ln for ln in steps[first + 1 :])
