"""`resformer COMMAND --help` prints the command's own usage and flags with their help and exits 0, for every command
(one fresh interpreter each: the exit status is the point), and the headline door answers too."""

import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest
from tiers import fast_few

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


def _help(*args):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-m", *args, "--help"], capture_output=True, text=True, env=env, timeout=120)
    return r, r.stdout + r.stderr


def usage_line(module_name: str) -> str:
    """The first line of a command module's docstring (absl's --help prints the program's docstring), read from the
    file: importing several commands in one process would define their absl flags twice."""
    return ast.get_docstring(ast.parse((COMMANDS_DIR / f"{module_name}.py").read_text())).splitlines()[0]


# the fast tier: the headline command, an absl reader of runs, argparse's prepare and lm-eval's harness
FAST_HELP = [("train", "main"), ("evaluate", "evaluate"), ("prepare", "prepare"), ("harness", "harness")]


@pytest.mark.parametrize("name,module", fast_few([(c, m) for c, m, _ in COMMANDS], FAST_HELP, True))
def test_help_lists_every_flag_and_exits_0(name, module):
    """Through the console script's dispatcher (`python -m resformer_jax COMMAND`): exit 0, no traceback, the
    command's own usage and every flag it defines with its help; harness (lm-eval's own CLI) names lm_eval."""
    r, out = _help("resformer_jax", name)
    assert r.returncode == 0 and "Traceback" not in out, f"`{name} --help` exited {r.returncode}: {out[-2000:]}"
    assert "Try --helpfull" not in r.stdout, r.stdout
    for flag in defined_flags(module):
        assert f"--{flag}" in r.stdout or f"--[no]{flag}" in r.stdout, (
            f"`resformer {name} --help` does not list --{flag}:\n{r.stdout}"
        )
    if name == "harness":
        assert "lm_eval" in r.stdout  # says the extra is needed for running (or lm-eval's own help)
    else:
        assert usage_line(module) in out, f"`resformer {name} --help` does not show its usage: {out[:500]}"
    if name == "evaluate":  # a docstring's `\\` line continuation stays a continuation, not a run of spaces
        assert "openbookqa \\\n" in r.stdout, r.stdout
    if name == "train":  # #73: names the --config.SECTION.FIELD syntax and where the fields are listed
        assert "--config.SECTION.FIELD=VALUE" in r.stdout and "resformer_jax/config.py" in r.stdout, r.stdout[:2000]


def test_the_headline_door_answers_help_and_an_unknown_command_is_named():
    """`python -m resformer_jax.main --help` (the headline command) shows train's usage; `resformer nonsense` exits 2
    listing the commands."""
    r, out = _help("resformer_jax.main")
    assert r.returncode == 0 and "Traceback" not in out and usage_line("main") in out, out[-2000:]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-m", "resformer_jax", "nonsense"], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "unknown command 'nonsense'" in r.stderr and "commands:" in r.stderr
