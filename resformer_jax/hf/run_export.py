"""A run's checkpoint written as a Hugging Face model folder (what `resformer export` does: it checks the target,
loads the run through load.py and hands the loaded run here, so hf/ imports nothing above it)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import jax

from resformer_jax import storage
from resformer_jax.errors import UserError
from resformer_jax.hf.export import export_params
from resformer_jax.hf.llama_import import is_export
from resformer_jax.rundir import RunDir


class ExportError(UserError):
    """An export target that would lose data or look complete when it is not; the message says what to do."""


def check_target(run: RunDir, out: str, overwrite: bool) -> bool:
    """Refuses an --out that is a run directory (its config.json is the run's, which compare, sweep and evaluate
    read), a file, or a non-empty folder that is not an earlier export; an earlier export only with overwrite.
    Returns whether an earlier export is being replaced."""
    target = RunDir(out)
    if target.is_run() or (target.path.exists() and os.fspath(target.path) == os.fspath(run.path)):
        raise ExportError(
            f"--out={out} is a run directory; an export never writes into one (it would replace the "
            "run's config.json): give a new folder, e.g. --out=exports/NAME"
        )
    if not target.path.exists():
        return False
    if not target.path.is_dir():
        raise ExportError(f"--out={out} is a file; give a folder")
    if not any(target.path.iterdir()):
        return False
    if not is_export(target.path):
        raise ExportError(f"--out={out} is not empty and holds no earlier export; give a new or empty folder")
    if not overwrite:
        raise ExportError(f"--out={out} holds an earlier export; pass --overwrite to replace it, or give a new folder")
    return True


def export_run(run: RunDir, loaded, out: str, dtype: str = "float32", replacing: bool = False) -> dict:
    """Writes the loaded run (load.load_run's (cfg, params, step) of `run`) as OUT/config.json, model.safetensors
    (+ index), generation_config.json and the run's tokenizer; `replacing`: check_target found an earlier export
    there. Nothing half-written looks complete: locally the export is written beside OUT and moved into place
    whole; on object storage config.json is uploaded last."""
    cfg, params, step = loaded
    if storage.is_remote(out):
        if replacing:
            for f in storage.files_under(out):
                f.unlink()
        with storage.staged_dir(out) as local:  # safetensors writes local files; uploaded after, config.json last
            meta = _write(run, cfg, params, local, dtype)
    else:
        parent = os.path.dirname(os.path.abspath(out))
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out))}.partial-", dir=parent)
        try:
            meta = _write(run, cfg, params, staging, dtype)
            _apply_umask(staging)  # mkdtemp's folder is private (0700): the export gets the user's usual modes
            if os.path.isdir(out):  # an empty folder, or (with overwrite) an earlier export: replaced whole
                old = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out))}.old-", dir=parent)
                os.rename(out, os.path.join(old, "export"))
                os.rename(staging, out)
                shutil.rmtree(old)
            else:
                os.rename(staging, out)
        finally:
            if os.path.isdir(staging):
                shutil.rmtree(staging)
    return {"step": step, "out": out, "architectures": meta["architectures"], "tokenizer": meta["tokenizer"]}


def _apply_umask(folder: str) -> None:
    """Gives `folder` and everything in it the modes a plain mkdir and open would: 0777 and 0666 less the umask."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for root, dirs, files in os.walk(folder):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o777 & ~umask)
        for f in files:
            os.chmod(os.path.join(root, f), 0o666 & ~umask)


def _write(run: RunDir, cfg, params, local: str, dtype: str) -> dict:
    """The export's files in a local folder."""
    tok = run.tokenizer()
    meta = None
    if tok is not None:
        eot = tok.token_to_id("<|endoftext|>")
        meta = {"eot_id": eot}
        storage.copy_file(run.tokenizer_json, os.path.join(local, "tokenizer.json"))
        special = "<|endoftext|>" if eot is not None else None
        with open(os.path.join(local, "tokenizer_config.json"), "w") as f:
            json.dump(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "model_max_length": cfg.model.max_seq_len,
                    "bos_token": special,
                    "eos_token": special,
                    "unk_token": special,
                    "clean_up_tokenization_spaces": False,
                },
                f,
                indent=1,
            )
    hf_cfg = export_params(cfg.model, jax.device_get(params), local, dtype, meta)
    return {"architectures": hf_cfg["architectures"], "tokenizer": meta is not None}
