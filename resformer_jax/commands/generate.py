"""Generate text from a checkpoint with a KV cache.

  resformer generate --workdir=RUN --prompt "def fib(n):" --max_new_tokens 64
  resformer generate --workdir=RUN --prompts_file prompts.txt --temperature 0.8 --top_p 0.95
  resformer generate --workdir=RUN --prompt "def fib(n):" --repetition_penalty 1.2 --frequency_penalty 0.5
  resformer generate --workdir=hf/RUN --prompt "def fib(n):"   # a folder `resformer export` wrote

Reports the KV-cache bytes it allocated and decode tokens/s.
"""

from __future__ import annotations

import json
import sys
import time

from absl import flags

from resformer_jax.commands import common as cli

flags.DEFINE_string("workdir", None, "A run directory, or a folder `resformer export` wrote.", required=True)
flags.DEFINE_integer("step", None, "Checkpoint step (default: newest).")
flags.DEFINE_string("prompt", None, "Prompt text.")
flags.DEFINE_string("prompts_file", None, "File with one prompt per line.")
flags.DEFINE_string("prompt_ids", None, "Comma-separated token ids (runs without a tokenizer).")
flags.DEFINE_integer("max_new_tokens", 128, "Tokens to generate.")
flags.DEFINE_float("cache_gib", 0.0, "The paged KV cache's size in GiB, a device's (0: half the free memory).")
flags.DEFINE_float("temperature", 0.0, "0: greedy.")
flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens (0: off).")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (1: off).")
flags.DEFINE_float("min_p", 0.0, "Sample only tokens at least this times as likely as the most likely (0: off).")
flags.DEFINE_float("presence_penalty", 0.0, "Subtracted from a token's logit once it is in the output (vLLM's).")
flags.DEFINE_float("frequency_penalty", 0.0, "Subtracted from a token's logit per time it is in the output.")
flags.DEFINE_float("repetition_penalty", 1.0, "A prompt or output token's logit divided by it (> 1 repeats less).")
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_list("allowed_token_ids", [], "Only these token ids may be generated (vLLM's; comma-separated).")
flags.DEFINE_list("bad_words", [], "Words never generated (vLLM's; comma-separated; read with the run's tokenizer).")
flags.DEFINE_bool("stop_at_eot", True, "Stop a sequence at the end-of-text token.")
flags.DEFINE_multi_string("stop", [], "A stop string: the text ends before it (repeat the flag for several; vLLM's).")
flags.DEFINE_integer(
    "devices", 1, "Devices the engine runs on: rows and cache pages split over them (-1: every device)."
)
flags.DEFINE_integer(
    "decode_steps", 8, "Decode steps a program runs between readbacks (1: each token streamed as it is sampled)."
)
FLAGS = flags.FLAGS


SAMPLING_FLAGS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def sampling_knobs() -> dict:
    """The sampling flags as SamplingParams fields, checked by SamplingParams's own bounds."""
    from resformer_jax.engine import EngineError, SamplingParams

    if FLAGS.max_new_tokens < 1:
        raise cli.ConfigFlagError(f"--max_new_tokens={FLAGS.max_new_tokens}: must be at least 1")
    knobs = {name: getattr(FLAGS, name) for name in SAMPLING_FLAGS}
    try:
        knobs["allowed_token_ids"] = tuple(int(t) for t in FLAGS.allowed_token_ids)
    except ValueError:
        given = ",".join(FLAGS.allowed_token_ids)
        raise cli.ConfigFlagError(f"--allowed_token_ids={given}: give integer token ids, comma-separated") from None
    try:
        SamplingParams(max_tokens=FLAGS.max_new_tokens, **knobs).check()
    except EngineError as e:
        raise cli.ConfigFlagError(f"--{e}") from None
    return {"max_tokens": FLAGS.max_new_tokens, **knobs}


def parse_prompt_ids(text: str, vocab_size: int) -> list[int]:
    """Token ids from "1,2,3", each in [0, vocab_size) (an id outside would be clamped by the gather, silently
    generating for another prompt)."""
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise cli.ConfigFlagError(f"--prompt_ids={text!r}: expected comma-separated integers, e.g. 1,2,3") from None
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if not ids or bad:
        raise cli.ConfigFlagError(
            f"--prompt_ids: {bad or 'no ids'}: token ids must be in [0, {vocab_size}) (the model's vocabulary)"
        )
    return ids


def read_prompts(tok, vocab_size: int) -> list[list[int]]:
    """The prompts as token ids: --prompt_ids, or --prompt and --prompts_file's lines encoded by the run's tokenizer."""
    if FLAGS.prompt_ids:
        return [parse_prompt_ids(FLAGS.prompt_ids, vocab_size)]
    texts = [FLAGS.prompt] if FLAGS.prompt is not None else []
    if FLAGS.prompts_file:
        with open(FLAGS.prompts_file) as f:
            texts += [ln.rstrip("\n") for ln in f if ln.strip()]
    if not texts:
        raise cli.ConfigFlagError("give --prompt, --prompts_file or --prompt_ids")
    if tok is None:
        raise cli.ConfigFlagError(
            f"{FLAGS.workdir.rstrip('/')}/tokenizer.json not found (a run on synthetic data has no tokenizer); "
            "use --prompt_ids"
        )
    return [tok.encode(t, add_special_tokens=False).ids or [0] for t in texts]


def main(argv):
    cli.start()

    from resformer_jax.load import load_model

    with cli.exit_on_user_error():
        knobs = sampling_knobs()
        model, params, step, tok, _ = load_model(FLAGS.workdir, FLAGS.step)
        prompts = read_prompts(tok, model.vocab_size)
        if FLAGS.bad_words:
            if tok is None:
                raise cli.ConfigFlagError("--bad_words: this run has no tokenizer to read them with")
            from resformer_jax.engine.sampling import bad_words_ids

            knobs["bad_words_ids"] = bad_words_ids(
                lambda t: tok.encode(t, add_special_tokens=False).ids, FLAGS.bad_words
            )
        if FLAGS.stop and tok is None:
            raise cli.ConfigFlagError("--stop: this run has no tokenizer; stop strings need its text")
        knobs["stop"] = tuple(FLAGS.stop)
    eot = tok.token_to_id("<|endoftext|>") if tok is not None and FLAGS.stop_at_eot else None
    longest = max(len(p) for p in prompts)
    if longest + FLAGS.max_new_tokens > model.max_seq_len:
        fix = (
            f"shorten the {'prompt' if len(prompts) == 1 else 'longest prompt'} ({longest} tokens)"
            if longest >= model.max_seq_len
            else f"lower --max_new_tokens to {model.max_seq_len - longest} or less"
        )
        cli.fail(
            f"prompt + max_new_tokens = {longest + FLAGS.max_new_tokens} exceeds the model's max_seq_len="
            f"{model.max_seq_len}; {fix}"
        )
    # Every prompt at once through the engine: mixed lengths batched together, each its own seed.
    from resformer_jax.engine import Engine, SamplingParams
    from resformer_jax.engine.runner import engine_mesh

    with cli.exit_on_user_error():
        cache_bytes = FLAGS.cache_gib * 2**30 if FLAGS.cache_gib else None
        mesh = engine_mesh(FLAGS.devices)
        detokenize = tok.decode if tok is not None else None  # the engine ends text at stop strings
        engine = Engine(
            model, params, cache_bytes=cache_bytes, decode_steps=FLAGS.decode_steps, mesh=mesh, detokenize=detokenize
        )
        stop = (eot,) if eot is not None else ()
        sampling = [SamplingParams(**knobs, seed=FLAGS.seed + i, stop_ids=stop) for i in range(len(prompts))]
        t0 = time.perf_counter()
        requests = engine.generate(prompts, sampling)
    seconds = time.perf_counter() - t0
    report = {
        "step": step,
        "prompts": len(prompts),
        "kv_cache_bytes": engine.cache_bytes,
        "kv_cache_bytes_per_token": engine.bytes_per_token,
        "most_concurrent": engine.stats.most_concurrent,
        "generated_tokens": engine.stats.generated_tokens,
        "decode_tokens_per_s": round(engine.stats.generated_tokens / max(seconds, 1e-9), 1),
        "compiled_shapes": len(engine.stats.compiled_shapes),
    }
    print(json.dumps(report), file=sys.stderr)
    for p, r in zip(prompts, requests):
        if tok is not None:
            print(tok.decode(p) + r.text)
        else:
            print(",".join(str(t) for t in p + r.shown))
        print("-" * 40)


def cli_main():
    cli.run_app(main, sys.modules[__name__])
