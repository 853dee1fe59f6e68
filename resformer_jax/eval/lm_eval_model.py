"""lm-evaluation-harness on this project's checkpoints: the model `resformer_jax` (pip install -e '.[lm_eval]').

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from resformer_jax.errors import UserError
from resformer_jax.eval.loglik import ContinuationScorer, prepare
from resformer_jax.load import load_model

if TYPE_CHECKING:
    from resformer_jax.engine import Engine


class HarnessError(UserError, ValueError):
    """A model argument or request the adapter cannot serve; the message says what to change."""


@register_model("resformer_jax")
class ResformerLM(LM):
    def __init__(
        self,
        workdir: str,
        step: int | str | None = None,
        batch_size: int | str = 16,
        max_length: int | str | None = None,
        **kwargs,
    ):
        super().__init__()

        loaded = load_model(workdir, int(step) if step not in (None, "") else None)  # a run, or an export
        self.model, self.params, self.step, self.tok = loaded.model, loaded.params, loaded.step, loaded.tokenizer
        if self.tok is None:
            raise HarnessError(
                f"{workdir}/tokenizer.json not found: lm-eval needs the run's tokenizer (runs on "
                "synthetic data have none)"
            )
        self.eot_id = self.tok.token_to_id("<|endoftext|>")
        self.batch = int(batch_size) if str(batch_size).isdigit() else 0  # "auto": sized to memory
        # The context a request may use: the model's max_seq_len by default, what the export's
        # max_position_embeddings tells the stock `lm_eval --model hf`, so both score the same items alike.
        self.max_length = int(max_length or self.model.max_seq_len)
        if not 1 < self.max_length <= self.model.max_seq_len:
            raise HarnessError(
                f"max_length={self.max_length}: must be in [2, {self.model.max_seq_len}] (the model's max_seq_len)"
            )

        self.scorer = ContinuationScorer(self.model, self.params, self.max_length, self.batch)
        self._engine: Engine | None = None  # the decode engine, made at the first generation request

    @classmethod
    def create_from_arg_obj(cls, arg_dict, additional_config=None):
        """--model_args win over the harness's own --batch_size/--device (which it passes as well)."""
        merged = {k: v for k, v in (additional_config or {}).items() if v is not None}
        merged.update(arg_dict or {})
        return cls(**merged)

    @classmethod
    def create_from_arg_string(cls, arg_string, additional_config=None):
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    # ------------------------------------------------------------------ scoring
    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def _score(self, reqs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum log p(continuation | context), continuation is the greedy one) for token-id pairs."""
        too_long = [i for i, (_, cont) in enumerate(reqs) if len(cont) > self.max_length]
        if too_long:
            # The stock Hugging Face model refuses these too: a continuation cut to its last tokens would be
            # scored in part, and its number would not be the task's.
            raise HarnessError(
                f"{len(too_long)} of {len(reqs)} requests have a continuation longer than the context "
                f"(max_length={self.max_length} tokens; the longest is "
                f"{max(len(reqs[i][1]) for i in too_long)}); they cannot be scored whole. Leave the "
                "task out, or use a model with a longer max_seq_len"
            )

        return self.scorer([prepare(ctx, cont, self.max_length) for ctx, cont in reqs])

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        pairs = []
        for req in requests:
            ctx, cont = req.args
            if not ctx:  # an empty context: condition on the end-of-text token, as the harness does
                pairs.append(([self.eot_id], self.encode(cont)))
            else:
                pairs.append((self.encode(ctx), self.encode(cont)))
        return self._score(pairs)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for req in requests:
            (text,) = req.args[:1]
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    token_list=self.encode(text), prefix_token=self.eot_id, max_seq_len=self.max_length, context_len=1
                )
            ]
            out.append(sum(ll for ll, _ in self._score(windows)))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False):
        """Every request at once through the decode engine (batched, mixed lengths; a handful of compiles), each
        stopping at the end-of-text token, its max_gen_toks or the first of its `until` strings."""
        from resformer_jax.engine import Engine, SamplingParams
        from resformer_jax.engine.sampling import bad_words_ids

        if self._engine is None:
            # the engine detokenizes: `until` strings end a request and its text there
            self._engine = Engine(self.model, self.params, max_batch=max(self.batch, 16), detokenize=self.tok.decode)
        engine = self._engine
        reqs = []
        for req in requests:
            ctx, kw = req.args
            kw = dict(kw or {})
            until = kw.get("until") or [self.tok.decode([self.eot_id])]
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kw.get("max_gen_toks", 256))
            temperature = float(kw.get("temperature", 0.0)) if kw.get("do_sample", False) else 0.0
            prompt = (self.encode(ctx) or [self.eot_id])[-max(1, self.model.max_seq_len - max_new) :]
            max_new = min(max_new, self.model.max_seq_len - len(prompt))
            params = SamplingParams(
                max_tokens=max_new,
                temperature=temperature,
                top_k=int(kw.get("top_k", 0) or 0),
                top_p=float(kw.get("top_p", 1.0) or 1.0),
                stop_ids=(self.eot_id,),
                stop=tuple(u for u in until if u),
                allowed_token_ids=tuple(kw.get("allowed_token_ids") or ()),  # vLLM's, as gen_kwargs entries
                bad_words_ids=bad_words_ids(self.encode, kw.get("bad_words") or ()),
            )
            reqs.append(engine.submit(prompt, params))
        while engine.busy:
            engine.step()
        return [r.text for r in reqs]
