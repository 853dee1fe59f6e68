"""`resformer COMMAND --help` prints the command's own flags with their help and exits 0, for every command."""

import pathlib
import re
import subprocess
import sys

import pytest

from resformer_jax.commands.cli import COMMANDS

COMMANDS_DIR = pathlib.Path(__file__).resolve().parents[2] / "resformer_jax" / "commands"


def defined_flags(module_name: str) -> list[str]:
    """The flags a command module defines, read from its source (importing every command in one process would
    define --workdir twice)."""
    if module_name == "prepare":  # argparse's options, in the library's data_prep/prepare.py
        source = (COMMANDS_DIR.parent / "data_prep" / "prepare.py").read_text()
        return re.findall(r"add_argument\(\s*\"--(\w+)\"", source)
    source = (COMMANDS_DIR / f"{module_name}.py").read_text()
    return re.findall(r"\bDEFINE_\w+\(\s*\"(\w+)\"", source)


@pytest.mark.parametrize("name,module", [(c, m) for c, m, _ in COMMANDS])
def test_help_lists_every_flag_and_exits_0(name, module):
    out = subprocess.run(
        [sys.executable, "-m", "resformer_jax", name, "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, f"`resformer {name} --help` exited {out.returncode}: {out.stderr[-2000:]}"
    assert "Try --helpfull" not in out.stdout, out.stdout
    for flag in defined_flags(module):
        assert f"--{flag}" in out.stdout or f"--[no]{flag}" in out.stdout, (
            f"`resformer {name} --help` does not list --{flag}:\n{out.stdout}"
        )
    if name == "harness":
        assert "lm_eval" in out.stdout  # says the extra is needed for running (or lm-eval's own help)


def test_usage_lines_keep_their_continuations():
    """A docstring's `\\` line continuation stays a continuation (not a run of spaces) in --help."""
    out = subprocess.run(
        [sys.executable, "-m", "resformer_jax", "evaluate", "--help"], capture_output=True, text=True, timeout=120
    )
    assert "openbookqa \\\n" in out.stdout, out.stdout


def test_train_help_says_how_to_set_any_config_field():
    """#73: `train --help` names the --config.SECTION.FIELD syntax and where the fields are listed."""
    r = subprocess.run([sys.executable, "-m", "resformer_jax", "train", "--help"], capture_output=True, text=True)
    assert r.returncode == 0
    assert "--config.SECTION.FIELD=VALUE" in r.stdout and "resformer_jax/config.py" in r.stdout, r.stdout[:2000]
