"""The project is defined in pyproject.toml; this shim lets Apache Beam's Dataflow runner package it for its workers
(`--setup_file=./setup.py`, README's Dataflow command), which needs a setup.py."""

from setuptools import setup

setup()
