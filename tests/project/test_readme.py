"""README's two top commands are what CI runs, exactly, after the lint."""

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
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


def test_ci_lints_first_and_sets_up_nothing_readme_uses_before_its_commands():
    """CI lints first, in a venv of its own outside the checkout, and pins versions through PIP_CONSTRAINT; nothing
    before README's first command touches the .venv README makes or installs into the system's Python."""
    script = (ROOT / ".ci" / "run").read_text()
    steps = [ln.strip() for ln in script.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    first = next(i for i, ln in enumerate(steps) if 'README_COMMANDS[0]}"' in ln and ln.startswith("bash"))
    before = steps[:first]
    assert any("readme_commands.py" in ln for ln in before), "CI must read the commands from README"
    assert any("ruff" in ln and "check" in ln for ln in before), "CI lints before anything else"
    assert any(ln.startswith("export PIP_CONSTRAINT=") and "constraints.txt" in ln for ln in before)
    assert (ROOT / "constraints.txt").is_file()
    touches = [ln for ln in before if ".venv" in ln or re.search(r"(^|\s)(pip3?|python3?\s+-m\s+pip)\s", ln)]
    assert not touches, f"CI sets up something README's commands would find before them: {touches}"
    lint = [ln for ln in before if re.search(r"\bvenv\b|\bpip\b", ln)]
    assert all("LINT_VENV" in ln for ln in lint), f"the linter's venv must be its own: {lint}"
