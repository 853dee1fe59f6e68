"""Prints README's two top commands (install + demo; the tests), one per line, exactly as written.

They are the non-comment lines of README's first ```bash block. `.ci/run` runs what this prints, so CI runs
what a new user copies, and tests/project/test_readme.py fails when the block stops holding exactly those two.
"""

import pathlib
import sys


def readme_commands(readme: pathlib.Path) -> list[str]:
    text = readme.read_text()
    start = text.index("```bash\n") + len("```bash\n")
    block = text[start : text.index("```", start)]
    return [ln.strip() for ln in block.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


if __name__ == "__main__":
    cmds = readme_commands(pathlib.Path(__file__).resolve().parents[1] / "README.md")
    if len(cmds) != 2:
        sys.exit(f"README's first bash block must hold exactly two commands (install + demo, tests); it holds {cmds}")
    print("\n".join(cmds))
