"""Per-layer analysis of a checkpoint: the paper's Eqs. 11-13 and Figs. 1, 9, 15.

  resformer analyze --workdir=RUN --data=PREPARED_DIR [--num_sequences 1000] [--workdir=RUN_B]

Per layer: entropy of token importance (Eq. 11, head-averaged attention),
mean pairwise cosine similarity of hidden states (Eq. 13), the eigen-spectrum
of the values' second-moment matrix (Eq. 12), the share of attention on the
first token, and mean value and hidden-state norms. Writes JSON, PNG plots and
TensorBoard scalars; a second --workdir is overlaid in the same plots, written into each run's analysis/ (or --out).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from absl import flags
from etils import epath

from resformer_jax.commands import common as cli

flags.DEFINE_multi_string("workdir", [], "Run directory (give twice to overlay two runs).")
flags.DEFINE_multi_string(
    "hf_model",
    [],
    "A local Hugging Face Llama/Mistral folder (config.json, *.safetensors, "
    "tokenizer.json) to analyse, e.g. Fig. 1 right; repeatable, overlays with --workdir.",
)
flags.DEFINE_string(
    "text_file",
    None,
    "--hf_model: text to analyse, tokenized with the model's tokenizer.json "
    "(or give --data, prepared with that tokenizer).",
)
flags.DEFINE_integer("seq_len", 512, "--hf_model: tokens per analysed sequence.")
flags.DEFINE_enum(
    "text_unit",
    "line",
    ["line", "paragraph", "stream"],
    "--text_file: each line (or blank-line "
    "separated paragraph) a document encoded on its own with BOS first and truncated, as the authors' "
    "scripts; stream: one token stream cut into windows.",
)
flags.DEFINE_integer("step", None, "Checkpoint step (default: newest).")
flags.DEFINE_string("data", None, "Prepared corpus folder (default: the run's own data).")
flags.DEFINE_integer("num_sequences", 1000, "Sequences to analyse (the paper: 1,000).")
flags.DEFINE_enum("split", "train", ["train", "validation"], "Analyse training sequences (as the paper) or validation.")
flags.DEFINE_enum(
    "value",
    "own",
    ["own", "mixed"],
    "Eq. 12 on each layer's own V_n (default) or the value it attends over (ResFormer's mix, SVFormer's V_1).",
)
flags.DEFINE_integer("batch", 8, "Sequences per forward pass.")
flags.DEFINE_string("out", None, "Output folder (default: FIRST_RUN/analysis).")
FLAGS = flags.FLAGS


def _save(ax, path, xlabel: str, title: str):
    """A finished plot as PNG at `path` (local or object storage), closed; returns the path. Layer and eigenvalue
    axes are counts: integer ticks."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from resformer_jax.storage import save_figure

    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.legend()
    fig = ax.figure
    for each in fig.axes:
        each.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path


def plot(results: list[dict], out: epath.Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes = lambda: plt.subplots(figsize=(5, 3.5))[1]
    files = []
    titles = {
        "entropy": "entropy of token importance (Eq. 11)",
        "similarity": "token similarity (Eq. 13)",
        "first_token": "attention share of the first token",
        "value_norm": "mean value norm",
        "hidden_norm": "mean hidden-state norm",
    }
    for key, title in titles.items():
        ax = axes()
        for r in results:
            y, run = r["layers"][key], os.path.basename(str(r["workdir"]).rstrip("/"))
            ax.plot(range(1, len(y) + 1), y, marker="o", label=f"{r['variant']} ({run})")
        files.append(_save(ax, out / f"{key}.png", "layer", title))
    ax = axes()
    for r in results:
        for key, label in (("fig3_eq3_vs_eq2", "Eq. 3"), ("fig3_eq6_vs_eq2", "Eq. 6")):
            y = r["layers"][key]
            ax.plot(range(2, len(y) + 1), y[1:], marker="o", label=f"{label}, {r['variant']}")
    title = "cosine similarity to Eq. 2's output (Fig. 3)"
    files.append(_save(ax, out / "fig3_mapping_similarity.png", "layer", title))
    ax = axes()
    for r in results:
        for n in (0, len(r["layers"]["spectrum"]) - 1):
            ev = r["layers"]["spectrum"][n]
            ax.semilogy(range(1, len(ev) + 1), [max(e, 1e-12) for e in ev], label=f"{r['variant']} layer {n + 1}")
    files.append(_save(ax, out / "spectrum.png", "eigenvalue index", "value eigen-spectrum (Eq. 12)"))
    ax = axes()
    for r in results:
        y = r["layers"]["largest_eigenvalue"]
        ax.plot(range(1, len(y) + 1), y, marker="o", label=r["variant"])
    title = "largest eigenvalue of the values' second moment (Fig. 9 right)"
    files.append(_save(ax, out / "largest_eigenvalue.png", "layer", title))
    return files


def main(argv):
    cli.start()
    from resformer_jax.metrics import Writer
    from resformer_jax.rundir import RunDir
    from resformer_jax.storage import run_path, write_json

    with cli.exit_on_user_error():
        for name, least in (("num_sequences", 1), ("batch", 1), ("seq_len", 2)):
            if FLAGS[name].value < least:
                raise cli.ConfigFlagError(f"--{name}={FLAGS[name].value}: must be at least {least}")
        if not FLAGS.workdir and not FLAGS.hf_model:
            from resformer_jax.hf.llama_import import HFError

            raise HFError("give --workdir=RUN (or --hf_model=DIR) to analyse")
        from resformer_jax.analysis.per_layer import analyze_run

        shared = (FLAGS.data, FLAGS.num_sequences, FLAGS.batch, FLAGS.split, FLAGS.value)
        results = [analyze_run(w, FLAGS.step, *shared) for w in FLAGS.workdir]
        text: dict[str, Any] = dict(text_file=FLAGS.text_file, seq_len=FLAGS.seq_len, text_unit=FLAGS.text_unit)
        results += [analyze_run(None, None, *shared, hf_model=h, **text) for h in FLAGS.hf_model]
    with cli.exit_on_user_error():
        # Without --out, every analysed run gets the overlay in its own analysis/ folder (not the first one only).
        outs = (
            [run_path(FLAGS.out)]
            if FLAGS.out
            else [RunDir(w).analysis_dir for w in FLAGS.workdir] or [run_path(FLAGS.hf_model[0]) / "analysis"]
        )
        for out in outs:
            out.mkdir(parents=True, exist_ok=True)
            write_json(out / "analysis.json", results, indent=1)
    for out in outs:
        files = plot(results, out)
    for r in results:
        hf = r["source"] != "run"  # never write into a model folder
        w = Writer(outs[0] / "tb" / r["variant"] if hf else RunDir(r["workdir"]).tensorboard)
        for key in ("entropy", "similarity", "first_token", "value_norm", "hidden_norm"):
            for n, v in enumerate(r["layers"][key]):
                w.scalars(r["step"] or 0, {f"analysis/{key}/layer_{n + 1:02d}": v})
        w.close()
        print(f"{r['variant']:>10} entropy per layer: " + " ".join(f"{v:.3f}" for v in r["layers"]["entropy"]))
        print(f"{r['variant']:>10} similarity per layer: " + " ".join(f"{v:.3f}" for v in r["layers"]["similarity"]))
    for out in outs:
        print(f"wrote {out / 'analysis.json'} and {', '.join(f.name for f in files)} in {out}")


def cli_main():
    cli.run_app(main, sys.modules[__name__])
