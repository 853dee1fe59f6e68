"""Hugging Face interop, import and export apart: llama_import.py reads Llama-family checkpoints (local
safetensors, nothing downloaded) as this project's model; export.py writes a run's parameters and config in HF's
layout, run_export.py the whole folder; modeling_resformer.py is the torch twin an export carries."""
