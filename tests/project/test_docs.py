"""Every command line in README.md and docs/*.md names a command that exists, only flags that command defines,
config files that exist and config fields those files have. README's two top commands are run by CI itself."""

import ast
import functools
import importlib.util
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
from commands import command_flags

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Programs a doc may show that are not this project's (their flags are their own).
OTHERS = {"pip", "tensorboard", "gcloud", "gcsfuse", "sbatch", "python3", "ssh", "export", "cd", "git"}


def command_lines(doc: pathlib.Path) -> list[str]:
    """The shell commands of a doc's ```bash blocks: continuation lines joined, comments dropped, split at
    `&&`, `;` and `|`."""
    blocks = re.findall(r"```bash\n(.*?)```", doc.read_text(), re.S)
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split, lexer.commenters = True, "#"
            current: list[str] = []
            for token in lexer:
                if token in ("&&", ";", "|", "||", "&"):
                    commands.append(current)
                    current = []
                else:
                    current.append(token)
            commands.append(current)
    return [c for c in commands if c]


def entry(tokens: list[str]) -> tuple[str, list[str]] | None:
    """(what runs: a resformer_jax.commands module, 'data_prep.prepare' or a script path, its arguments)."""
    from resformer_jax.commands.cli import COMMANDS

    modules = {name: module for name, module, _ in COMMANDS}
    while tokens and re.fullmatch(r"[A-Z_]+=\S*", tokens[0]):  # VAR=value before a command
        tokens = tokens[1:]
    if not tokens:
        return None
    head = os.path.basename(tokens[0])
    if head == "resformer" and tokens[1] == "prepare":  # data_prep.prepare by its command name: argparse's flags
        return "data_prep.prepare", tokens[2:]
    if head == "resformer":
        return "commands." + modules.get(tokens[1], "UNKNOWN:" + tokens[1]), tokens[2:]
    if head.startswith("python") and tokens[1:2] == ["-m"]:
        module, rest = tokens[2], tokens[3:]
        if module == "resformer_jax":
            return "commands." + modules.get(rest[0], "UNKNOWN:" + rest[0]), rest[1:]
        if module.startswith("resformer_jax."):
            short = module.removeprefix("resformer_jax.")
            return "commands." + {"main": "main", "bench": "bench", "compile": "compile"}.get(
                short, "UNKNOWN:" + short
            ), rest
        if module in ("data_prep.prepare", "pytest", "venv", "pip"):
            return module, rest
        return "UNKNOWN:" + module, rest
    if tokens[0].startswith(("launch/", "./")) or (head == "sbatch" and any(t.startswith("launch/") for t in tokens)):
        return "script", tokens
    if head in OTHERS or head.startswith("python"):
        return None
    return None


@functools.cache
def flags_of(module: str) -> frozenset[str] | None:
    """The flags a command accepts: absl's registry with only that command's flags in it (tests/support/commands.py:
    several commands define the same flag names), lm-eval's options for harness, data_prep.prepare's argparse ones."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "RESFORMER_NO_XLA_DEFAULTS": "1"}
    if module == "commands.harness":  # lm-eval's own CLI: its `run` subcommand's options (the legacy form inserts it)
        if importlib.util.find_spec("lm_eval") is None:
            return None  # its lines are lm-eval's flags; CI installs the lm_eval extra and checks them
        cmd = [sys.executable, "-m", "resformer_jax", "harness", "run", "--help"]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=180)
        return frozenset(re.findall(r"--[a-z_]+", r.stdout))
    if module == "data_prep.prepare":
        code = (
            "import json, argparse, data_prep.prepare as m\n"
            "opts = []\n"
            "orig = argparse.ArgumentParser.parse_args\n"
            "def grab(self, *a, **k):\n"
            "    opts.extend(o for a_ in self._actions for o in a_.option_strings)\n"
            "    print(json.dumps(opts)); raise SystemExit(0)\n"
            "argparse.ArgumentParser.parse_args = grab\n"
            "m.main([])\n"
        )
    else:  # in this process, as run_command registers a command's flags (absl's own beside them)
        return command_flags(f"resformer_jax.{module}")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=180)
    assert r.returncode == 0, f"importing {module} failed: {r.stderr[-1500:]}"
    return frozenset(json.loads(r.stdout.strip().splitlines()[-1]))


def config_has(cfg_path: str, field: str) -> bool:
    from resformer_jax.commands.common import load_config_file

    node = load_config_file(cfg_path)
    for part in field.split("."):
        if not hasattr(node, "keys") or part not in node:
            return False
        node = node[part]
    return True


def all_commands():
    for doc in DOCS:
        for tokens in command_lines(doc):
            found = entry(tokens)
            if found is not None:
                yield doc.relative_to(ROOT), " ".join(tokens), found


def test_docs_exist_and_readme_links_every_one():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200, "README is the short entry: move depth to docs/"
    for doc in DOCS[1:]:
        assert f"(docs/{doc.name})" in readme, f"README's map of docs/ does not link {doc.name}"
    for doc in DOCS:  # relative links between docs resolve
        for target in re.findall(r"\]\(([^)#:]+\.md)\)", doc.read_text()):
            assert (doc.parent / target).is_file(), f"{doc.name} links {target}, which does not exist"


def _bench_flags() -> dict[str, tuple[str, ...]]:
    """commands/bench.py's BENCHMARK_FLAGS, read from the file (importing it would define its flags here)."""
    tree = ast.parse((ROOT / "resformer_jax" / "commands" / "bench.py").read_text())
    table = next(n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "BENCHMARK_FLAGS")
    return ast.literal_eval(table)


BENCH_FLAGS = _bench_flags()


# slow (over the fast tier's 5 s, cold, 2 cores): imports every command and parses its flags
@pytest.mark.slow
def test_every_documented_command_exists_with_its_flags_and_config_fields():
    problems = []
    checked = 0
    for doc, line, (what, args) in all_commands():
        where = f"{doc}: {line[:110]}"
        if what.startswith("UNKNOWN") or "UNKNOWN" in what:
            problems.append(f"{where}: no such command ({what})")
            continue
        if what == "script":
            scripts = [a for a in args if a.startswith(("launch/", "./"))]
            problems += [f"{where}: {s} does not exist" for s in scripts if not (ROOT / s).is_file()]
            continue
        if what in ("pytest", "venv", "pip"):
            continue
        checked += 1
        known = flags_of(what)
        if known is None:
            continue
        config = None
        for a in args:
            if a.startswith("--config="):
                config = a.split("=", 1)[1]
        for a in args:
            if not a.startswith("--") or a == "--":
                continue
            name = a.split("=", 1)[0]
            if name.startswith("--config."):
                if config in (None, "...") or re.search(r":[A-Z]", config):  # FILE:VARIANT placeholders cannot load
                    continue
                if not config_has(config, name.removeprefix("--config.")):
                    problems.append(f"{where}: {config} has no field {name.removeprefix('--config.')}")
            elif name not in known and not (name.startswith("--no") and "--" + name[4:] in known):
                problems.append(f"{where}: {what} has no flag {name}")
        if what == "commands.bench" and args and args[0] in BENCH_FLAGS:
            allowed = {f"--{n}" for n in BENCH_FLAGS[args[0]]} | {"--config", "--compare", "--help"}
            stray = [a.split("=", 1)[0] for a in args if a.startswith("--") and not a.startswith("--config.")]
            problems += [f"{where}: bench {args[0]} does not read {n}" for n in stray if n not in allowed]
        if config is not None and config != "...":
            path = config.split(":", 1)[0]
            if not (ROOT / path).is_file():
                problems.append(f"{where}: config file {path} does not exist")
    assert checked > 40, f"only {checked} command lines found: the parser no longer reads the docs"
    assert not problems, "documented commands that would not run as written:\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_no_session_diaries_in_docs(doc):
    """Docs are written for a reader: today's numbers and how they are measured, not a log of who did what when."""
    text = doc.read_text()
    assert not re.search(r"\b(this|next|a (second|third|fourth|fifth|sixth)) (session|round)\b", text, re.I), doc


def _suite_counts(session) -> tuple[int, int]:
    """(fast tier, everything) as pytest collects tests/: this session's own collection when it is the whole suite
    with nothing deselected (README's command), else a fresh pytest's collection."""
    config = session.config
    whole = [(config.invocation_params.dir / a).resolve() for a in config.args] == [ROOT / "tests"]
    if whole and not config.option.markexpr and not config.option.keyword and not config.option.deselect:
        return sum(not item.get_closest_marker("slow") for item in session.items), len(session.items)
    # one collection gives both counts: "FAST/ALL tests collected (N deselected)"
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "not slow",
         str(ROOT / "tests")],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    found = re.search(r"(\d+)/(\d+) tests collected", r.stdout)
    assert found, r.stdout[-2000:]
    return int(found.group(1)), int(found.group(2))


# slow (over the fast tier's 5 s, cold, 2 cores) where a fresh pytest collects the whole suite
@pytest.mark.slow
def test_readme_test_counts_are_the_suites(request):
    """README's "about N tests" (everything, and the fast tier) against what pytest collects here, within 15% (a
    module whose extra is not installed is skipped at collection)."""
    text = (ROOT / "README.md").read_text()
    m = re.search(r"runs everything \(about ([\d,]+) tests.*?: about ([\d,]+) tests\b", text, re.S)
    assert m, "README's Tests section no longer states the two counts this test checks"
    stated_all, stated_fast = (int(x.replace(",", "")) for x in m.groups())
    fast, everything = _suite_counts(request.session)
    for stated, actual, what in ((stated_all, everything, "all"), (stated_fast, fast, "fast")):
        assert abs(stated - actual) <= 0.15 * actual, f"README says about {stated} tests ({what}); {actual} collected"


POINTER_FOLDERS = "model|kernels|train|data|engine|serve|compile|bench|eval|hf|analysis|parallel|storage|commands"


def _headings(doc: pathlib.Path) -> list[str]:
    return [h.strip().lower() for h in re.findall(r"^#+ (.*)$", doc.read_text(), re.M)]


def test_every_pointer_in_code_and_docs_resolves():
    """A comment or doc that says where something is must be right: "README's X section" names a README heading,
    "docs/<doc>.md" and "docs/<doc>.md (X)" a doc and its heading, "model/attention.py" (any package folder) and
    "tests/<room>/<file>.py" a file, a markdown link its target file and #anchor."""
    sources = [*sorted((ROOT / "resformer_jax").rglob("*.py")), *sorted((ROOT / "data_prep").glob("*.py"))]
    sources += [ROOT / "pyproject.toml", *DOCS, *sorted((ROOT / "tests").rglob("*.py"))]
    readme = _headings(ROOT / "README.md")
    broken = []
    for src in sources:
        text = src.read_text()
        flat = re.sub(r"\s*\n\s*#?\s*", " ", text)  # comments and docstrings wrap: read them as one line
        where = src.relative_to(ROOT)
        for name in re.findall(r"README's ([A-Z][\w ,-]*?) sections?\b", flat):
            for part in re.split(r",? and |, ", name):
                if not any(part.lower() in h for h in readme):
                    broken.append(f"{where}: README has no section {part!r}")
        for doc, section in re.findall(r"\bdocs/([\w-]+\.md)(?: \(([A-Z][\w ,-]+)\))?", flat):
            path = ROOT / "docs" / doc
            if not path.is_file():
                broken.append(f"{where}: docs/{doc} does not exist")
            elif section and not any(section.lower() in h for h in _headings(path)):
                broken.append(f"{where}: docs/{doc} has no section {section!r}")
        for rel in re.findall(rf"(?<![\w/.])((?:{POINTER_FOLDERS})/[\w/]+\.py)\b", text):
            if not (ROOT / "resformer_jax" / rel).is_file() and not (ROOT / rel).is_file():
                broken.append(f"{where}: {rel} does not exist")
        for rel in re.findall(r"(?<![\w/.])(tests/[\w/]+\.py)\b", text):
            if not (ROOT / rel).is_file():
                broken.append(f"{where}: {rel} does not exist")
        if src.suffix == ".md":
            for target, anchor in re.findall(r"\]\(([^)#\s]*?)(?:#([\w-]+))?\)", text):
                if target.startswith(("http://", "https://", "mailto:")):
                    continue
                path = (src.parent / target) if target else src
                if not path.exists():
                    broken.append(f"{where}: link to {target} does not resolve")
                elif anchor and path.suffix == ".md":
                    slugs = {re.sub(r"[^\w\- ]", "", h).replace(" ", "-") for h in _headings(path)}
                    if anchor.lower() not in slugs:
                        broken.append(f"{where}: {target}#{anchor} names no heading")
    assert not broken, "pointers that no longer hold:\n" + "\n".join(broken)
