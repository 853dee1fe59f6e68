"""Serving a run: an OpenAI-compatible HTTP endpoint on the decode engine (`resformer serve`).

engine_thread.py  the engine in a thread of its own (the event loop never waits on a device step); requests and
                  cancellations reach it through a queue, tokens come back through each request's callback
metrics.py        Prometheus metrics, named as vLLM names them
app.py            the FastAPI app: /v1/completions (streamed or not), /v1/models, /health, /metrics
"""
