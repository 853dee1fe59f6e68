"""docs/scaling-out.md's compile table (#92): a row from each compile report, the ladder command that keeps the rows
it has, and the trainer's start-up words on the compiled step's bound."""

import json
import os

import jax
import jax.numpy as jnp
from commands import parsed_config_flag, run_command

from resformer_jax.compilation import scale_table
from resformer_jax.compilation.roofline import step_bound_line

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GIB = 2**30


def report(size="1b", data=1, fsdp=8, microbatch=64, total=40 * GIB, hbm=60 * GIB, bound=2.0, coll=(30e9, 0.5)):
    """A compile report as `resformer compile` prints it, with the fields the table reads."""
    tokens = 2048 * 2048
    return {
        "target": "h100x8",
        "fits": True,
        "device_memory_bytes": hbm,
        "mesh": {"data": data, "fsdp": fsdp, "context": 1},
        "microbatch": microbatch,
        "remat": "dots",
        "steps": [
            {
                "step": "train",
                "memory_per_device": {"total": total},
                "roofline": {
                    "per_op_bound_s": bound,
                    "mfu_ceiling_model": 0.71,
                    "collective_bytes_per_device": coll[0],
                    "by_kind": {"collective": {"bound_s": coll[1]}},
                },
            }
        ],
        "run": {"tokens_a_step": tokens, "token_budget": 1000 * tokens, "steps": 1000},
        "at_the_bound": {
            "tokens_per_s": tokens / bound, "days": 1000 * bound / 86400, "days_at_0_6": 1000 * bound / 86400 / 0.6
        },
    }  # fmt: skip


def test_a_row_says_mesh_memory_headroom_bound_and_days():
    row = scale_table.Row("1b", "svformer", "h100x8")
    assert row.config == "configs/svformer_1b.py:h100x8"
    assert row.command() == ["compile", "--config=configs/svformer_1b.py:h100x8", "--target=h100x8", "--steps=train"]
    assert "--nodes=4" in scale_table.Row("7b", "svformer", "4xh100x8").command()
    head, rule, line = scale_table.markdown({row: report()})
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert len(cells) == head.count("|") - 1 and rule.count("---") == len(cells)
    assert cells[:6] == ["1b", "svformer", "h100x8", "1 x 8", "8", "dots"]
    assert cells[6] == "40.0 GiB (33% of 60)"
    assert cells[7:9] == ["2.00 s", "0.710"]
    assert cells[9] == "30.0 GB (25%)"
    assert cells[10] == f"{2048 * 2048 / 2.0:,.0f}"
    assert cells[11] == f"{2000 / 86400:.1f} ({2000 / 86400 / 0.6:.1f})"
    # over 90% of the device: said in the row
    tight = scale_table.markdown({row: report(total=57 * GIB)})[2]
    assert "does not fit with 10% free" in tight
    # several nodes: the collectives' time were they all on the links between nodes
    multi = scale_table.markdown({scale_table.Row("1b", "svformer", "4xh100x8"): report(data=4)})[2]
    assert f"{30e9 / scale_table.INTER_NODE_BYTES_PER_S / 2.0:.0%} were all of it between nodes" in multi
    assert "not compiled" in scale_table.markdown({row: None})[2]
    # a cluster whose setting unrolls the layers says so beside its remat policy
    unrolled = scale_table.markdown({scale_table.Row("1b", "svformer", "v6e-64"): report()})[2]
    assert "| dots, layers unrolled |" in unrolled and "unrolled" not in line


def test_the_ladder_prints_the_table_from_the_rows_it_has_and_refuses_unknown_names(tmp_path):
    for file, _ in scale_table.VARIANTS:
        row = scale_table.Row("1b", file, "h100x8")
        (tmp_path / f"{row.name}.json").write_text("compiling...\n" + json.dumps(report()) + "\n")
    cmd = [f"--scale_table={tmp_path}"]
    done = run_command("compile", *cmd, "--scale_sizes=1b", "--scale_clusters=h100x8")  # in-process: nothing compiles
    assert done.returncode == 0, done.stderr
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("|")]
    assert len(lines) == 2 + 3 and [ln.split("|")[2].strip() for ln in lines[2:]] == [
        "transformer", "resformer", "svformer"
    ]  # fmt: skip
    assert "+ resformer compile" not in done.stderr  # every row was there: nothing compiled
    bad = run_command("compile", *cmd, "--scale_clusters=h100x16")
    assert bad.returncode == 2 and "--scale_clusters: unknown ['h100x16']" in bad.stderr


def test_a_report_cut_short_is_no_row(tmp_path):
    (tmp_path / "x.json").write_text('{"target": "h1')
    assert scale_table.read(tmp_path / "x.json") is None and scale_table.read(tmp_path / "missing.json") is None


def test_the_start_up_bound_is_the_compiled_steps_roofline_on_a_known_chip_and_nothing_on_a_cpu():
    compiled = jax.jit(lambda a, b: a @ b).lower(jnp.ones((256, 256)), jnp.ones((256, 256))).compile()
    flops = 2 * 256**3
    line = step_bound_line(compiled.as_text, "NVIDIA H100 80GB HBM3", flops)
    assert line.startswith("step bound ") and "on NVIDIA H100" in line and "not a timing" in line
    mfu = float(line.split("MFU ceiling ")[1].split(";")[0])
    assert 0 < mfu <= 1

    def never():
        raise AssertionError("the HLO was read for a CPU")

    assert step_bound_line(never, "cpu", flops) == ""


def test_each_preset_row_names_a_config_file_and_its_cluster():
    for row in scale_table.rows():
        path, _, cluster = row.config.partition(":")
        assert os.path.exists(os.path.join(ROOT, path)) and cluster == row.cluster


def test_a_preset_named_without_its_cluster_compiles_with_the_targets_setting(monkeypatch):
    """#92's check as written (`resformer compile --config=configs/svformer_7b.py --target=v5p-128`, and
    `--target=h100x8 --nodes=4`): the preset's setting for that cluster, as `:v5p-128` would give, with the
    --config.* overrides applied after; a cluster named, a target no preset is sized for, or the preset's own
    default cluster leave the config as given."""
    from resformer_jax.commands.compile import config_for_target
    from resformer_jax.compilation.targets import parse_target
    from resformer_jax.presets import scale_config

    def resolved(config, target, nodes=1):
        flag = parsed_config_flag(["resformer compile", f"--config={config}", "--config.train.steps=7"])
        said = []
        return config_for_target(flag, parse_target(target, nodes=nodes), said.append), said

    def setting(c):
        return c.mesh.data, c.mesh.fsdp, c.train.microbatch, c.model.remat, c.model.scan_layers, c.mesh.target

    monkeypatch.chdir(ROOT)
    for target, nodes, cluster in (("v5p-128", 1, "v5p-128"), ("h100x8", 4, "4xh100x8"), ("v6e-64", 1, "v6e-64")):
        c, said = resolved("configs/svformer_7b.py", target, nodes)
        assert setting(c) == setting(scale_config("7b", "svformer", cluster)), (target, setting(c))
        assert c.train.steps == 7 and c.model.value_residual == "svformer"
        assert said == [
            f"configs/svformer_7b.py is sized for h100x8; compiling its {cluster} setting (mesh, microbatch, remat), "
            f"as configs/svformer_7b.py:{cluster}"
        ]
    h100 = setting(scale_config("7b", "svformer", "h100x8"))
    for config, target in (
        ("configs/svformer_7b.py:v6e-64", "v5p-128"),  # a cluster named: as named
        ("configs/svformer_7b.py", "v5p-64"),  # no preset is sized for it: as given (the mesh check then says so)
        ("configs/svformer_7b.py", "h100x8"),  # its default
    ):
        c, said = resolved(config, target)
        want = setting(scale_config("7b", "svformer", "v6e-64")) if ":" in config else h100
        assert setting(c) == want and c.train.steps == 7 and said == [], (config, target)
    c, said = resolved("configs/resformer_82m.py", "v5p-128")  # not a scale-out preset
    assert said == [] and c.train.steps == 7
