"""Serve a run over HTTP, OpenAI-compatible, on the decode engine.

  resformer serve --workdir=RUN [--step=S] [--port=8000] [--cache_gib=4]
  resformer serve --workdir=hf/RUN      # a folder `resformer export` wrote (config.json, model.safetensors)
  curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
      -d '{"prompt": "def fib(n):", "max_tokens": 32, "temperature": 0}'

POST /v1/completions (text, texts, token ids or lists of them; echo and logprobs; "stream": true for server-sent
events), POST /v1/chat/completions (with --chat_template=FILE), GET /v1/models, POST /tokenize and /detokenize,
GET /tokenizer_info, GET /health, GET /metrics (Prometheus). SIGTERM or Ctrl-C: stops accepting, lets the requests
in flight finish for --shutdown_budget_s, then ends each one left with finish_reason "abort" and exits 0. Needs the
serve extra: pip install -e '.[serve]'.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import socket
import sys
import threading

from absl import flags
from etils import epath

from resformer_jax.commands import common as cli

flags.DEFINE_string("workdir", None, "A run directory, or a folder `resformer export` wrote.", required=True)
flags.DEFINE_integer("step", None, "Checkpoint step (default: newest).")
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0: every interface).")
flags.DEFINE_integer("port", 8000, "Port to listen on.")
flags.DEFINE_float("cache_gib", 0.0, "The paged KV cache's size in GiB, a device's (0: half the free memory).")
flags.DEFINE_integer("max_batch", 64, "Requests decoded together at most.")
flags.DEFINE_integer("page_size", 16, "Tokens a cache page holds.")
flags.DEFINE_integer(
    "devices", 1, "Devices the engine runs on: rows and cache pages split over them (-1: every device)."
)
flags.DEFINE_integer(
    "decode_steps",
    8,
    "Decode steps a program runs between readbacks while every row is busy or requests wait; below that load, one "
    "(each token streamed as it is sampled). 1: always one.",
)
flags.DEFINE_bool(
    "prefix_cache",
    True,
    "Keep full pages of prompts and reuse them for prompts that start with the same tokens (vLLM's automatic "
    "prefix caching); --noprefix_cache (or --prefix_cache=false) turns it off.",
)
flags.DEFINE_integer(
    "prefill_chunk",
    256,
    "Prompt tokens a row reads a step: a long prompt is read in chunks between the running rows' decode steps, "
    "so it never stalls their streams for longer than one chunk (vLLM's chunked prefill).",
)
flags.DEFINE_integer("prefill_rows", 4, "Prompts read (a chunk each) in one step at most.")
flags.DEFINE_bool(
    "compile_at_start",
    True,
    "Compile every program a request without logprobs, penalties or token masks can need (each row, token and page "
    "bucket up to --max_batch and the context) before listening: serving them compiles nothing. False: each "
    "compiles on the first request that needs it.",
)
flags.DEFINE_string(
    "compilation_cache_dir",
    "~/.cache/resformer_jax/xla",
    "JAX's persistent compilation cache: a restart loads the programs compiled before ('': none; the "
    "JAX_COMPILATION_CACHE_DIR environment variable, where set, wins).",
)
flags.DEFINE_string("model_name", None, "The name /v1/models gives (default: the run directory's name).")
flags.DEFINE_float(
    "shutdown_budget_s", 30.0, "On SIGTERM: seconds the requests in flight get to finish; then they end as 'abort'."
)
flags.DEFINE_string(
    "chat_template",
    None,
    "A Jinja chat template file for /v1/chat/completions (as vLLM takes it; default: the export's "
    "tokenizer_config.json's, if it has one).",
)
FLAGS = flags.FLAGS


def main(argv):
    cli.start()
    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        cli.fail(f"serving needs {', '.join(missing)}, not installed; install the extra: pip install -e '.[serve]'")
    import uvicorn

    from resformer_jax.engine import Engine
    from resformer_jax.engine.runner import engine_mesh
    from resformer_jax.load import load_model
    from resformer_jax.serve.app import make_app
    from resformer_jax.serve.engine_thread import EngineThread
    from resformer_jax.serve.metrics import ServeMetrics

    _persistent_compilation_cache(FLAGS.compilation_cache_dir)
    with cli.exit_on_user_error():
        _check_workdir(FLAGS.workdir)
        template = _chat_template(FLAGS.chat_template, FLAGS.workdir)
        sock = _bind(FLAGS.host, FLAGS.port)  # before the model loads: a busy port is said at once
        model_cfg, params, step, tokenizer, trained_len = load_model(FLAGS.workdir, FLAGS.step)
        cache_bytes = FLAGS.cache_gib * 2**30 if FLAGS.cache_gib else None
        sizes = {
            k: FLAGS[k].value
            for k in ("max_batch", "page_size", "decode_steps", "prefix_cache", "prefill_chunk", "prefill_rows")
        }
        detokenize = tokenizer.decode if tokenizer is not None else None  # the engine ends text at stop strings
        engine = Engine(
            model_cfg,
            params,
            cache_bytes=cache_bytes,
            mesh=engine_mesh(FLAGS.devices),
            detokenize=detokenize,
            stream=True,
            **sizes,
        )
    if FLAGS.compile_at_start:
        import psutil

        print(f"compiling {len(engine.program_shapes())} programs ...", file=sys.stderr, flush=True)
        rss = psutil.Process().memory_info().rss
        seconds = engine.compile_all(log=lambda line: print(line, file=sys.stderr, flush=True))
        held = (psutil.Process().memory_info().rss - rss) / 2**20
        print(
            f"compiled and ran once {len(engine.runner.programs)} programs in {seconds:.1f} s, holding {held:.0f} "
            "MiB of host memory: requests without logprobs, penalties or token masks compile nothing while served "
            "(/metrics: resformer:compiles_after_start)",
            file=sys.stderr,
            flush=True,
        )
    name = FLAGS.model_name or os.path.basename(os.path.normpath(FLAGS.workdir))
    metrics = ServeMetrics(name)
    thread = EngineThread(engine, metrics)
    thread.start()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    print(_capacity_line(name, step, engine, tokenizer, trained_len), file=sys.stderr, flush=True)
    app = make_app(thread, tokenizer, name, metrics, chat_template=template, trained_len=trained_len)
    budget = FLAGS.shutdown_budget_s
    # timeout_graceful_shutdown: a backstop, the requests left were ended at `budget`
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=budget + 3.0)

    class Server(uvicorn.Server):
        """uvicorn's server; its first exit signal also starts the budget, after which the requests still in flight
        end with finish_reason "abort" (a final chunk and [DONE]), so uvicorn's own cut never comes."""

        def handle_exit(self, sig, frame):
            if not self.should_exit:
                timer = threading.Timer(budget, lambda: app.state.serving.abort_all(f"the {budget:g} s budget ran out"))
                timer.daemon = True
                timer.start()
            super().handle_exit(sig, frame)

    # uvicorn restores the handlers it found and raises the signal again once it has shut down: a handler of ours
    # lets that end in exit 0 instead of the default action (death by signal)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        Server(config).run(sockets=[sock])  # SIGTERM/SIGINT: stop accepting, finish what is in flight
    finally:
        thread.stop()
    print("server stopped", file=sys.stderr, flush=True)


def _capacity_line(name: str, step: int | None, engine, tokenizer, trained_len: int | None) -> str:
    """What `serve` prints at start: where, the cache's size, and how many sequences of the full context it holds."""
    m, loaded = engine.model_cfg, "exported" if step is None else f"step {step}"
    full = engine.pool.usable // engine.pool.pages_for(engine.max_len)
    return (
        f"serving {name} ({loaded}, {m.value_residual}) on http://{FLAGS.host}:{FLAGS.port}: cache "
        f"{engine.cache_bytes / 2**30:.2f} GiB, {engine.pool.usable} pages of {engine.page_size} tokens "
        f"({engine.bytes_per_token} bytes a token): {full} sequences of the full {engine.max_len}-token context"
        + (f", on {engine.shards} devices" if engine.shards > 1 else "")
        + ("; prefix cache on" if engine.prefix_cache else "; prefix cache off")
        + (
            f"; trained at {trained_len} tokens: prompts past that are extrapolation"
            if trained_len and trained_len < engine.max_len
            else ""
        )
        + ("" if tokenizer is not None else "; this run trained on token ids only: prompts must be token ids")
    )


def _persistent_compilation_cache(folder: str) -> None:
    """JAX's persistent compilation cache in `folder` (a restart loads what the last start compiled), unless the
    environment names one already or `folder` is empty."""
    if not folder or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    import jax

    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def _check_workdir(path: str) -> None:
    if os.path.isfile(path):
        raise cli.ConfigFlagError(f"--workdir={path} is a file, not a directory; give a run directory or an export")
    if "://" not in path and not os.path.isdir(path):
        raise cli.ConfigFlagError(f"--workdir={path}: the run directory does not exist; check the path")


def _bind(host: str, port: int):
    """The listening socket, bound now (uvicorn serves on it): a port in use is one line before anything loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise cli.ConfigFlagError(
            f"--port={port}: cannot listen on {host}:{port} ({e.strerror}); another process holds it: choose "
            "another --port or stop that process"
        ) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _chat_template(path: str | None, workdir: str) -> str | None:
    """--chat_template's text, or the export's tokenizer_config.json's chat_template, or None (a base model)."""
    if path:
        if not os.path.isfile(path):
            raise cli.ConfigFlagError(f"--chat_template={path}: no such file; give a Jinja template file")
        with open(path) as f:
            return f.read()
    config = epath.Path(workdir) / "tokenizer_config.json"  # local or on object storage, as the export
    template = json.loads(config.read_text()).get("chat_template") if config.is_file() else None
    return template if isinstance(template, str) else None


def cli_main():
    cli.run_app(main, sys.modules[__name__])
