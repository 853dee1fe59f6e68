"""The per-layer analysis of a run or an imported model (what `resformer analyze` prints and plots):
attention entropy (Eq. 11), token similarity (Eq. 13), the first token's attention share, value and hidden-state
norms, the value eigen-spectrum (Eq. 12) and its largest eigenvalue (Fig. 9 right), Fig. 3's mapping similarity.
Sequences stream through in batches and every measure is a running mean, so memory is one batch."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
from tokenizers import Tokenizer

from resformer_jax.analysis import measures
from resformer_jax.data.pipeline import train_reader, validation_sets
from resformer_jax.hf.llama_import import HFError
from resformer_jax.load import load_run
from resformer_jax.model import Transformer
from resformer_jax.model.config import ModelConfig


class RunningMean:
    """The mean of scalars or equal-shape arrays added one at a time (float64 sums; nothing else kept)."""

    def __init__(self):
        self.total, self.count = None, 0

    def add(self, x) -> None:
        x = np.asarray(x, np.float64)
        self.total = x.copy() if self.total is None else self.total + x
        self.count += 1

    def mean(self):
        return self.total / self.count


def layer_tensors(inter: dict, num_layers: int) -> dict:
    """{name: [L, ...]} stacked over layers from the capture model's intermediates."""
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
    if split == "train":
        read, _ = train_reader(cfg)
        return [read(g) for g in range(num_sequences)]
    sets = validation_sets(cfg, batch, 0, all_records=True)
    return [row for batches in sets.values() for b in batches for row in b][:num_sequences]


def hf_sequences(folder: str, text_file: str, seq_len: int, num_sequences: int, text_unit: str = "line"):
    """Sequences of seq_len + 1 tokens from a text file, tokenized with the model's own tokenizer.

    text_unit "line" (default) or "paragraph" (blank-line separated): each document encoded on its own, the
    model's BOS first (config.json's bos_token_id), truncated at the sequence length, as the authors' analysis
    scripts encode each sample (attention-sink measures depend on the first token); documents shorter than a
    sequence are left out. "stream": one token stream cut into consecutive windows (only the first has a BOS)."""
    tok_path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(tok_path):
        raise HFError(f"{folder} has no tokenizer.json to tokenize --text_file with; give --data prepared with it")
    tok = Tokenizer.from_file(tok_path)
    with open(text_file, encoding="utf-8") as f:
        text = f.read()
    n_tok = seq_len + 1
    if text_unit == "stream":
        ids = tok.encode(text).ids
        n = min(num_sequences, len(ids) // n_tok)
        if n == 0:
            raise HFError(f"{text_file} has {len(ids)} tokens, fewer than one sequence of {n_tok}; lower --seq_len")
        return [np.asarray(ids[i * n_tok : (i + 1) * n_tok], np.int32) for i in range(n)]
    cfg_path = os.path.join(folder, "config.json")
    bos = None
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            bos = json.load(f).get("bos_token_id")
    bos = bos[0] if isinstance(bos, list) else bos
    docs = [d.strip() for d in (text.split("\n\n") if text_unit == "paragraph" else text.splitlines()) if d.strip()]
    out = []
    for d in docs:
        ids = ([bos] if bos is not None else []) + tok.encode(d, add_special_tokens=False).ids
        if len(ids) >= n_tok:
            out.append(np.asarray(ids[:n_tok], np.int32))
            if len(out) == num_sequences:
                break
    if not out:
        raise HFError(
            f"no {text_unit} of {text_file} holds {n_tok} tokens (--seq_len + 1, BOS included); lower "
            "--seq_len, or use --text_unit=stream"
        )
    return out


def check_analyzable(m: ModelConfig) -> None:
    """The capture model records each layer's attention matrix; Eq. 2's cross-layer mapping has none of its own."""
    if m.mapping == "cross_layer":
        from resformer_jax.config import ConfigError

        raise ConfigError(
            "analyze cannot measure a mapping=cross_layer run: its layers >= 2 attend through Eq. 2's "
            "joint softmax over two layers' keys, which has no per-layer attention matrix for the "
            "entropy, first-token and Fig. 3 measures; analyse the attention-mapping runs instead"
        )


def analyze_run(
    workdir,
    step,
    data,
    num_sequences,
    batch,
    split="train",
    value="own",
    hf_model=None,
    text_file=None,
    seq_len=512,
    text_unit="line",
) -> dict:
    if hf_model:  # a pretrained Llama-family model, imported from its safetensors (resformer_jax/hf/llama_import.py)
        from resformer_jax.config import DataConfig, RunConfig
        from resformer_jax.hf.llama_import import HFError, load_hf_llama
        from resformer_jax.resolve import for_backend

        m, params = load_hf_llama(hf_model)
        if seq_len > m.max_seq_len:  # the flag's default (512) is longer than a small model's context
            raise HFError(
                f"--seq_len={seq_len} exceeds the context of {hf_model} ({m.max_seq_len} tokens); pass --seq_len "
                f"{m.max_seq_len} or less"
            )
        source = {"path": data, "source": "array_record"} if data else {}
        cfg = RunConfig(
            model=for_backend(m.replace(attention_impl="reference")), data=DataConfig(seq_len=seq_len, **source)
        )
        step, workdir = None, hf_model
        if data:
            seqs = analysis_sequences(cfg, split, num_sequences, batch)
        elif text_file:
            seqs = hf_sequences(hf_model, text_file, seq_len, num_sequences, text_unit)
        else:
            raise HFError("--hf_model needs --text_file or --data to analyse")
    else:
        # The capture model needs the attention matrix itself: the reference impl, chosen through the same path.
        cfg, params, step = load_run(workdir, step, attention_impl="reference")
        if data:
            cfg = cfg.replace(data=dataclasses.replace(cfg.data, path=data, source="array_record"))
        seqs = analysis_sequences(cfg, split, num_sequences, batch)
    check_analyzable(cfg.model)
    model = Transformer(cfg.model, capture=True)
    fwd = jax.jit(lambda t: model.apply({"params": params}, t, mutable=["intermediates"])[1]["intermediates"])
    L = cfg.model.num_layers
    # Every measure is a running mean over the sequences as they stream through (per-example spectra are
    # averaged, as the paper does): memory is one batch's tensors, whatever --num_sequences is.
    acc = {
        k: [RunningMean() for _ in range(L)]
        for k in ("entropy", "similarity", "first_token", "value_norm", "hidden_norm")
    }
    spectra = [RunningMean() for _ in range(L)]
    fig3 = {"eq3": [RunningMean() for _ in range(L)], "eq6": [RunningMean() for _ in range(L)]}
    sim_all = [RunningMean() for _ in range(L + 2)]  # embedding output, each block's output, final-norm output
    for b in range(0, len(seqs), batch):
        chunk = np.stack(seqs[b : b + batch])[:, :-1]
        inter = jax.device_get(fwd(chunk))
        t = layer_tensors(inter, L)
        ends = {0: np.asarray(inter["embedding_output"][0]), L + 1: np.asarray(inter["final_norm_output"][0])}
        for r in range(len(chunk)):
            for i, hs in ends.items():
                sim_all[i].add(measures.mean_token_similarity(hs[r]))
        for n in range(L):
            for r in range(len(chunk)):
                A, v, h = t["attn_probs"][n][r], t["values"][n][r], t["hidden"][n][r]
                sim_all[n + 1].add(measures.mean_token_similarity(h))
                v_spec = (t["values_own"] if value == "own" else t["values"])[n][r]
                if n >= 1:  # Fig. 3: layer n's exact cross-layer attention over layer n - 1, and its approximations
                    sim = measures.mapping_similarity(
                        t["queries"][n][r],
                        t["keys"][n][r],
                        t["values_own"][n][r],
                        t["keys"][n - 1][r],
                        t["values_own"][n - 1][r],
                    )
                    for key in fig3:
                        fig3[key][n].add(sim[key])
                spectra[n].add(measures.value_spectrum(v_spec.reshape(len(v_spec), -1)))  # Eq. 12
                acc["entropy"][n].add(measures.token_importance_entropy(A))
                acc["similarity"][n].add(measures.mean_token_similarity(h))
                acc["first_token"][n].add(measures.first_token_share(A))
                acc["value_norm"][n].add(float(np.linalg.norm(v.reshape(len(v), -1), axis=-1).mean()))
                acc["hidden_norm"][n].add(float(np.linalg.norm(h, axis=-1).mean()))
    res: dict[str, list[float | None]] = {k: [float(x.mean()) for x in v] for k, v in acc.items()}
    res["spectrum"] = [s.mean().tolist() for s in spectra]  # Eq. 12: per example, then averaged
    # Fig. 9 right: the largest eigenvalue of each layer's value second-moment matrix
    res["largest_eigenvalue"] = [float(s.mean()[0]) for s in spectra]
    res["similarity_all_hidden_states"] = [float(x.mean()) for x in sim_all]
    # Fig. 3 (meant for a trained vanilla model): per layer n >= 2, cosine similarity with Eq. 2 over layer n - 1
    res["fig3_eq3_vs_eq2"] = [float(x.mean()) if x.count else None for x in fig3["eq3"]]
    res["fig3_eq6_vs_eq2"] = [float(x.mean()) if x.count else None for x in fig3["eq6"]]
    return {
        "workdir": workdir,
        "step": step,
        "num_sequences": len(seqs),
        "variant": os.path.basename(os.path.normpath(hf_model)) if hf_model else cfg.model.value_residual,
        "source": "hugging face checkpoint" if hf_model else "run",
        "split": split,
        "spectrum_value": "each layer's own V_n" if value == "own" else "the value each layer attends over",
        "similarity_all_hidden_states_are": ["embedding output"]
        + [f"block {n} output" for n in range(1, L + 1)]
        + ["final RMSNorm output"],
        "layers": res,
    }
