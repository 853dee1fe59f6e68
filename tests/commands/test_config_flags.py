"""Every config field on the command line, parsed as the commands parse it (the pre-parse check, then absl with
ml_collections' own flag parser, then the typed config), in-process: a value of the wrong kind is one line and
exit 2 in every section, and the ablation configs' own spellings (MIDDLE, LAST3) are taken."""

import dataclasses
import os
import typing

import pytest
from commands import parsed_config_flag

from resformer_jax.commands import common
from resformer_jax.config import SECTIONS, validate
from resformer_jax.errors import EXIT_USER_ERROR
from resformer_jax.model.config import ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny.py")


def parse(*overrides: str):
    """The ConfigDict `resformer train --config=configs/tiny.py OVERRIDES` trains: the commands' pre-parse check
    first (it exits 2 with one line on what it refuses), then absl's parse of the flags (a FlagValues of its own)."""
    argv = ["resformer train", f"--config={TINY}", *overrides]
    common.check_config_flags(argv)
    return parsed_config_flag(argv, TINY).value


def typed(*overrides: str):
    """As the command does: the typed config, a user error printed as one line with its exit code."""
    with common.exit_on_user_error():
        return validate(parse(*overrides))


def wrong_kind(kind) -> str | None:
    """A value of another kind than the field's, as text on the command line (None: any text is of a str's kind)."""
    origin = typing.get_origin(kind)
    if kind is bool:
        return "maybe"
    if kind in (int, float):
        return "x"
    if kind is tuple or origin is tuple:
        return "1,x"
    return None


def every_field():
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            yield section, f.name, hints[f.name]


FIELDS = [(s, n, k) for s, n, k in every_field() if wrong_kind(k) is not None]


def test_the_wrong_kind_table_covers_every_field_that_is_not_text():
    kinds = {k for _, _, k in every_field() if wrong_kind(k) is None}
    assert kinds == {str}, f"fields of a kind this test gives no wrong value: {kinds}"
    assert len(FIELDS) > 60, len(FIELDS)


@pytest.mark.parametrize(("section", "name", "kind"), FIELDS, ids=[f"{s}.{n}" for s, n, _ in FIELDS])
def test_a_wrong_kind_on_the_command_line_is_one_line_and_exit_2(section, name, kind, capsys):
    value = wrong_kind(kind)
    with pytest.raises(SystemExit) as stop:
        typed(f"--config.{section}.{name}={value}")
    assert stop.value.code == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("error:") and f"{section}.{name}" in err[0], err[0]
    assert "Traceback" not in err[0]


@pytest.mark.parametrize(
    ("flag", "field", "want"),
    [
        ("--config.model.svformer_anchors=MIDDLE", "svformer_anchors", (2,)),
        ("--config.model.svformer_anchors=1,MIDDLE", "svformer_anchors", (1, 2)),
        ("--config.model.svformer_anchors=3", "svformer_anchors", (3,)),
        ("--config.model.sparse_layers=LAST3", "sparse_layers", (2, 3)),
        ("--config.model.sparse_layers=(2,3)", "sparse_layers", (2, 3)),
    ],
)
def test_layer_lists_take_the_ablation_configs_names_and_numbers(flag, field, want):
    variant = (
        ["--config.model.value_residual=svformer"]
        if field == "svformer_anchors"
        else ["--config.model.resformer_lambdas=sparse"]
    )
    cfg = typed(*variant, flag)
    assert getattr(cfg.model, field) == want  # tiny: 3 layers, MIDDLE = 2, LAST3 = 2..3 (never layer 1)


@pytest.mark.parametrize(
    "flags_",
    [
        ("--config.model.value_residual=svformer", "--config.model.svformer_anchors=3,x"),
        ("--config.model.resformer_lambdas=sparse", "--config.model.sparse_layers=1,x"),
        ("--config.model.value_residual=svformer", "--config.model.svformer_anchors=FIRST"),
    ],
)
def test_a_layer_list_item_that_is_no_number_nor_name_is_one_line(flags_, capsys):
    with pytest.raises(SystemExit) as stop:
        typed(*flags_)
    assert stop.value.code == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "MIDDLE" in err[0] and "LAST3" in err[0], err


def test_the_layer_names_resolve_by_depth_as_the_ablation_configs_do():
    """apply_ablation and the typed config resolve a name alike, for any depth."""
    from resformer_jax.presets import apply_ablation, paper_config

    for size, middle, last3 in (("82m", (5,), (6, 7, 8)), ("468m", (13,), (22, 23, 24))):
        c = apply_ablation(paper_config(size), {"value_residual": "svformer", "svformer_anchors": "MIDDLE"})
        assert c.model.svformer_anchors == middle
        m = ModelConfig.of({**paper_config(size).model.to_dict(), "resformer_lambdas": "sparse"})
        assert m.replace(sparse_layers=("LAST3",)).sparse_layers == last3


@pytest.mark.slow  # two tiny runs of two steps (about 10 s each)
@pytest.mark.parametrize(
    "flags_",
    [
        ("--config.model.value_residual=svformer", "--config.model.svformer_anchors=MIDDLE"),
        ("--config.model.resformer_lambdas=sparse", "--config.model.sparse_layers=LAST3"),
    ],
)
def test_the_ablations_spelt_as_their_configs_train_from_the_command_line(flags_, tmp_path):
    from resformer_jax.commands.training import run

    cfg = parse(*flags_, "--config.train.steps=2", "--config.train.warmup_steps=1", "--config.train.eval_every=2")
    assert run(cfg, str(tmp_path / "run")) == 0
