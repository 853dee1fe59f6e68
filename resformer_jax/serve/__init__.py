"""Serving a run: an OpenAI-compatible HTTP endpoint on the decode engine (`resformer serve`).

Its notes (the reasons, what was measured): docs/modules.md.
"""
