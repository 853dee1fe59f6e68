"""Per-layer analysis of a checkpoint: the paper's Eqs. 11-13 and Figs. 1, 9, 15.

  python -m resformer_jax.analyze --workdir=RUN --data=PREPARED_DIR [--num_sequences 1000] [--workdir=RUN_B]

Per layer: entropy of token importance (Eq. 11, head-averaged attention),
mean pairwise cosine similarity of hidden states (Eq. 13), the eigen-spectrum
of the values' second-moment matrix (Eq. 12), the share of attention on the
first token, and mean value and hidden-state norms. Writes JSON, PNG plots and
TensorBoard scalars; a second --workdir is overlaid in the same plots.
"""
from __future__ import annotations

import os

from absl import app, flags

flags.DEFINE_multi_string("workdir", [], "Run directory (give twice to overlay two runs).")
flags.DEFINE_multi_string("hf_model", [], "A local Hugging Face Llama/Mistral folder (config.json, *.safetensors, "
                          "tokenizer.json) to analyse, e.g. Fig. 1 right; repeatable, overlays with --workdir.")
flags.DEFINE_string("text_file", None, "--hf_model: text to analyse, tokenized with the model's tokenizer.json "
                    "(or give --data, prepared with that tokenizer).")
flags.DEFINE_integer("seq_len", 512, "--hf_model: tokens per analysed sequence.")
flags.DEFINE_integer("step", None, "Checkpoint step (default: newest).")
flags.DEFINE_string("data", None, "Prepared corpus folder (default: the run's own data).")
flags.DEFINE_integer("num_sequences", 1000, "Sequences to analyse (the paper: 1,000).")
flags.DEFINE_enum("split", "train", ["train", "validation"], "Analyse training sequences (as the paper) or validation.")
flags.DEFINE_enum("value", "own", ["own", "mixed"], "Eq. 12 on each layer's own V_n (default) or the value it attends "
                  "over (ResFormer's mix, SVFormer's V_1).")
flags.DEFINE_integer("batch", 8, "Sequences per forward pass.")
flags.DEFINE_string("out", None, "Output folder (default: FIRST_RUN/analysis).")
FLAGS = flags.FLAGS


def layer_tensors(inter: dict, num_layers: int) -> dict:
    """{name: [L, ...]} stacked over layers from the capture model's intermediates."""
    import numpy as np
    out = {}
    for name in ("attn_probs", "values", "values_own", "queries", "keys", "hidden"):
        per = []
        src = inter["layer_1"]
        per.append(np.asarray((src["attn"] if name != "hidden" else src)[name][0]))
        if "layers" in inter:
            blk = inter["layers"]["block"]
            stacked = np.asarray((blk["attn"] if name != "hidden" else blk)[name][0])
            per += list(stacked)
        else:
            for n in range(2, num_layers + 1):
                src = inter[f"layer_{n}"]
                per.append(np.asarray((src["attn"] if name != "hidden" else src)[name][0]))
        out[name] = per
    return out


def analysis_sequences(cfg, split: str, num_sequences: int, batch: int):
    """The first `num_sequences` sequences of the training stream (the run's own mixture, in step order) or of
    the validation split (every domain, in record order)."""
    from resformer_jax.data.pipeline import train_reader, validation_sets
    if split == "train":
        read, _ = train_reader(cfg)
        return [read(g) for g in range(num_sequences)]
    sets = validation_sets(cfg, batch, 0, all_records=True)
    return [row for batches in sets.values() for b in batches for row in b][:num_sequences]


def hf_sequences(folder: str, text_file: str, seq_len: int, num_sequences: int):
    """Consecutive windows of seq_len + 1 tokens of a text file, tokenized with the model's own tokenizer."""
    import numpy as np
    from tokenizers import Tokenizer
    from resformer_jax.hf import HFError
    tok_path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(tok_path):
        raise HFError(f"{folder} has no tokenizer.json to tokenize --text_file with; give --data prepared with it")
    with open(text_file, encoding="utf-8") as f:
        ids = Tokenizer.from_file(tok_path).encode(f.read()).ids
    n = min(num_sequences, len(ids) // (seq_len + 1))
    if n == 0:
        raise HFError(f"{text_file} has {len(ids)} tokens, fewer than one sequence of {seq_len + 1}; lower --seq_len")
    return [np.asarray(ids[i * (seq_len + 1):(i + 1) * (seq_len + 1)], np.int32) for i in range(n)]


def analyze_run(workdir, step, data, num_sequences, batch, split="train", value="own", hf_model=None,
                text_file=None, seq_len=512) -> dict:
    import jax
    import numpy as np
    from resformer_jax.analysis import measures
    from resformer_jax.model import Transformer
    from resformer_jax.train.setup import load_run
    if hf_model:  # a pretrained Llama-family model, imported from its safetensors (resformer_jax/hf.py)
        from resformer_jax.config import base_config
        from resformer_jax.hf import load_hf_llama
        cfg = base_config()
        cfg.model, params = load_hf_llama(hf_model)
        cfg.model.attention_impl = "reference"
        cfg.data.seq_len, step, workdir = seq_len, None, hf_model
        if data:
            cfg.data.path, cfg.data.source = data, "array_record"
            seqs = analysis_sequences(cfg, split, num_sequences, batch)
        elif text_file:
            seqs = hf_sequences(hf_model, text_file, seq_len, num_sequences)
        else:
            from resformer_jax.hf import HFError
            raise HFError("--hf_model needs --text_file or --data to analyse")
    else:
        # The capture model needs the attention matrix itself: the reference impl, chosen through the same path.
        cfg, params, step = load_run(workdir, step, attention_impl="reference")
        if data:
            cfg.data.path, cfg.data.source = data, "array_record"
        seqs = analysis_sequences(cfg, split, num_sequences, batch)
    model = Transformer(cfg.model, capture=True)
    fwd = jax.jit(lambda t: model.apply({"params": params}, t, mutable=["intermediates"])[1]["intermediates"])
    L = cfg.model.num_layers
    acc = {k: [[] for _ in range(L)] for k in ("entropy", "similarity", "first_token", "value_norm", "hidden_norm")}
    spectra = [[] for _ in range(L)]
    fig3 = {"eq3": [[] for _ in range(L)], "eq6": [[] for _ in range(L)]}
    sim_all = [[] for _ in range(L + 2)]  # embedding output, each block's output, final-norm output
    for b in range(0, len(seqs), batch):
        chunk = np.stack(seqs[b:b + batch])[:, :-1]
        inter = jax.device_get(fwd(chunk))
        t = layer_tensors(inter, L)
        ends = {0: np.asarray(inter["embedding_output"][0]), L + 1: np.asarray(inter["final_norm_output"][0])}
        for r in range(len(chunk)):
            for i, hs in ends.items():
                sim_all[i].append(measures.mean_token_similarity(hs[r]))
        for n in range(L):
            for r in range(len(chunk)):
                A, v, h = t["attn_probs"][n][r], t["values"][n][r], t["hidden"][n][r]
                sim_all[n + 1].append(measures.mean_token_similarity(h))
                v_spec = (t["values_own"] if value == "own" else t["values"])[n][r]
                if n >= 1:  # Fig. 3: layer n's exact cross-layer attention over layer n - 1, and its approximations
                    sim = measures.mapping_similarity(t["queries"][n][r], t["keys"][n][r], t["values_own"][n][r],
                                                      t["keys"][n - 1][r], t["values_own"][n - 1][r])
                    for key in fig3:
                        fig3[key][n].append(sim[key])
                spectra[n].append(v_spec.reshape(len(v_spec), -1))
                acc["entropy"][n].append(measures.token_importance_entropy(A))
                acc["similarity"][n].append(measures.mean_token_similarity(h))
                acc["first_token"][n].append(measures.first_token_share(A))
                acc["value_norm"][n].append(float(np.linalg.norm(v.reshape(len(v), -1), axis=-1).mean()))
                acc["hidden_norm"][n].append(float(np.linalg.norm(h, axis=-1).mean()))
    res = {k: [float(np.mean(x)) for x in v] for k, v in acc.items()}
    res["spectrum"] = [measures.mean_spectrum(s).tolist() for s in spectra]  # Eq. 12: per example, then averaged
    res["similarity_all_hidden_states"] = [float(np.mean(x)) for x in sim_all]
    # Fig. 3 (meant for a trained vanilla model): per layer n >= 2, cosine similarity with Eq. 2 over layer n - 1
    res["fig3_eq3_vs_eq2"] = [float(np.mean(x)) if x else None for x in fig3["eq3"]]
    res["fig3_eq6_vs_eq2"] = [float(np.mean(x)) if x else None for x in fig3["eq6"]]
    return {"workdir": workdir, "step": step, "num_sequences": len(seqs),
            "variant": os.path.basename(os.path.normpath(hf_model)) if hf_model else cfg.model.value_residual,
            "source": "hugging face checkpoint" if hf_model else "run",
            "split": split, "spectrum_value": "each layer's own V_n" if value == "own" else
            "the value each layer attends over",
            "similarity_all_hidden_states_are": ["embedding output"] + [f"block {n} output" for n in range(1, L + 1)]
            + ["final RMSNorm output"],
            "layers": res}


def plot(results: list[dict], out: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from resformer_jax.storage import save_figure
    files = []
    titles = {"entropy": "entropy of token importance (Eq. 11)", "similarity": "token similarity (Eq. 13)",
              "first_token": "attention share of the first token", "value_norm": "mean value norm",
              "hidden_norm": "mean hidden-state norm"}
    for key, title in titles.items():
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for r in results:
            y = r["layers"][key]
            ax.plot(range(1, len(y) + 1), y, marker="o", label=f"{r['variant']} ({os.path.basename(str(r['workdir']).rstrip('/'))})")
        ax.set_xlabel("layer")
        ax.set_title(title)
        ax.legend()
        fig.tight_layout()
        path = out / f"{key}.png"
        save_figure(fig, path)
        plt.close(fig)
        files.append(path)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for r in results:
        for key, label in (("fig3_eq3_vs_eq2", "Eq. 3"), ("fig3_eq6_vs_eq2", "Eq. 6")):
            y = r["layers"][key]
            ax.plot(range(2, len(y) + 1), y[1:], marker="o", label=f"{label}, {r['variant']}")
    ax.set_xlabel("layer")
    ax.set_title("cosine similarity to Eq. 2's output (Fig. 3)")
    ax.legend()
    fig.tight_layout()
    path = out / "fig3_mapping_similarity.png"
    save_figure(fig, path)
    plt.close(fig)
    files.append(path)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for r in results:
        for n in (0, len(r["layers"]["spectrum"]) - 1):
            ev = r["layers"]["spectrum"][n]
            ax.semilogy(range(1, len(ev) + 1), [max(e, 1e-12) for e in ev], label=f"{r['variant']} layer {n + 1}")
    ax.set_xlabel("eigenvalue index")
    ax.set_title("value eigen-spectrum (Eq. 12)")
    ax.legend()
    fig.tight_layout()
    path = out / "spectrum.png"
    save_figure(fig, path)
    plt.close(fig)
    files.append(path)
    return files


def main(argv):
    from resformer_jax.commands import common as cli
    cli.start()
    from resformer_jax.metrics import Writer
    from resformer_jax.rundir import RunDir
    from resformer_jax.storage import run_path, write_json
    with cli.exit_on_user_error():
        for name, least in (("num_sequences", 1), ("batch", 1), ("seq_len", 2)):
            if FLAGS[name].value < least:
                raise cli.ConfigFlagError(f"--{name}={FLAGS[name].value}: must be at least {least}")
        if not FLAGS.workdir and not FLAGS.hf_model:
            from resformer_jax.hf import HFError
            raise HFError("give --workdir=RUN (or --hf_model=DIR) to analyse")
        results = [analyze_run(w, FLAGS.step, FLAGS.data, FLAGS.num_sequences, FLAGS.batch, FLAGS.split, FLAGS.value)
                   for w in FLAGS.workdir]
        results += [analyze_run(None, None, FLAGS.data, FLAGS.num_sequences, FLAGS.batch, FLAGS.split, FLAGS.value,
                                hf_model=h, text_file=FLAGS.text_file, seq_len=FLAGS.seq_len) for h in FLAGS.hf_model]
    with cli.exit_on_user_error():
        out = (run_path(FLAGS.out) if FLAGS.out else RunDir(FLAGS.workdir[0]).analysis_dir if FLAGS.workdir
               else run_path(FLAGS.hf_model[0]) / "analysis")
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "analysis.json", results, indent=1)
    files = plot(results, out)
    for r in results:
        hf = r["source"] != "run"  # never write into a model folder
        w = Writer(out / "tb" / r["variant"] if hf else RunDir(r["workdir"]).tensorboard)
        for key in ("entropy", "similarity", "first_token", "value_norm", "hidden_norm"):
            for n, v in enumerate(r["layers"][key]):
                w.scalars(r["step"] or 0, {f"analysis/{key}/layer_{n + 1:02d}": v})
        w.close()
        print(f"{r['variant']:>10} entropy per layer: " + " ".join(f"{v:.3f}" for v in r["layers"]["entropy"]))
        print(f"{r['variant']:>10} similarity per layer: " + " ".join(f"{v:.3f}" for v in r["layers"]["similarity"]))
    print(f"wrote {out / 'analysis.json'} and {', '.join(f.name for f in files)} in {out}")


def cli_main():
    app.run(main)


if __name__ == "__main__":
    cli_main()
