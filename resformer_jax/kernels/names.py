"""The attention implementations by name: the one list the config validates against."""

import contextlib
import contextvars

import jax

# auto: resolved once per run by probing at the run's shapes (resolve.py).
# pallas: this project's flash attention (GPU, Triton); splash: JAX's TPU splash-attention kernel.
IMPLS = ("auto", "pallas", "cudnn", "splash", "chunked", "xla", "reference")
# Impls that run context-parallel (mesh.context > 1, kernels/attention.attention): xla and reference partitioned by XLA,
# the Pallas GPU kernel and TPU splash on each device's slices (queries at their positions); not cudnn, chunked.
CONTEXT_PARALLEL_IMPLS = ("pallas", "splash", "xla", "reference")

# The platform a program is being compiled for when it is not this machine's backend (compilation/aot.py compiles for
# TPU slices and GPUs from a CPU). The kernels read it to decide whether their interpreted (test) path is what
# will run; a context variable, so it holds only inside `compiling_for` and only in that thread.
_TARGET_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar("target_platform", default=None)
_TARGET_KIND: contextvars.ContextVar[str | None] = contextvars.ContextVar("target_kind", default=None)


@contextlib.contextmanager
def compiling_for(platform: str, device_kind: str | None = None):
    """Inside: programs are lowered for `platform` ('tpu' or 'cuda') and its `device_kind` (e.g. 'NVIDIA H100 SXM
    80GB'), not for the local backend."""
    token, kind = _TARGET_PLATFORM.set(platform), _TARGET_KIND.set(device_kind)
    try:
        yield
    finally:
        _TARGET_PLATFORM.reset(token)
        _TARGET_KIND.reset(kind)


def target_device_kind() -> str:
    """The device the program being traced will run on, in words: the compile target's inside `compiling_for`,
    else this machine's first device's ('' where unknown)."""
    kind = _TARGET_KIND.get()
    if kind is not None or _TARGET_PLATFORM.get() is not None:
        return kind or ""
    try:
        return jax.devices()[0].device_kind
    except RuntimeError:
        return ""


def target_backend() -> str:
    """The backend the program being traced will run on: the compile target inside `compiling_for`, else JAX's
    default backend ('gpu' for CUDA, as jax.default_backend() names it)."""
    target = _TARGET_PLATFORM.get()
    return jax.default_backend() if target is None else backend_of(target)


def backend_of(platform: str) -> str:
    """A lowering platform ('cuda', 'rocm', 'tpu') as jax.default_backend() names its backend ('gpu', 'tpu')."""
    return "gpu" if platform in ("cuda", "rocm", "gpu") else platform


ATTENTION_RESIDUALS = "attention_residuals"  # checkpoint_name of what an attention kernel's backward reads


def balanced_order(T: int, context: int):
    """The order a sequence's T tokens take under a context axis of `context` devices: cut into 2 x context
    slices, device r holds slices r and 2 x context - 1 - r (MaxText's and torchtitan's causal load balancing: each
    device's queries see as many keys as every other's). Device r's tokens are positions
    order[r * T // context : (r + 1) * T // context], ascending."""
    import numpy as np

    slices = np.arange(T).reshape(2 * context, T // (2 * context))
    return np.concatenate([np.concatenate([slices[r], slices[2 * context - 1 - r]]) for r in range(context)])


# Impls that mask documents (segment ids); cudnn (through jax.nn.dot_product_attention) takes no mask of this kind.
DOCUMENT_MASK_IMPLS = ("reference", "xla", "chunked", "pallas", "splash")


def auto_candidates(backend: str, documents: bool = False) -> tuple[list[str], dict[str, str]]:
    """(impls `auto` tries in order on this backend, {impl: why it is not tried}); documents: only the impls that
    mask packed documents."""
    candidates, rejected = _backend_candidates(backend)
    if documents:
        rejected.update({i: "it takes no document mask" for i in candidates if i not in DOCUMENT_MASK_IMPLS})
        candidates = [i for i in candidates if i in DOCUMENT_MASK_IMPLS]
    return candidates, rejected


def _backend_candidates(backend: str) -> tuple[list[str], dict[str, str]]:
    if backend == "gpu":
        return ["pallas", "cudnn", "xla"], {"splash": "backend 'gpu' is not a TPU"}
    if backend == "tpu":
        return ["splash", "xla"], {"pallas": "backend 'tpu' is not a GPU", "cudnn": "backend 'tpu' is not a GPU"}
    why = f"backend {backend!r} is not an accelerator (the kernel runs only interpreted here)"
    return ["chunked", "xla"], {"pallas": why, "splash": why, "cudnn": f"backend {backend!r} is not a GPU"}


def unprobed_auto(backend: str) -> str:
    """What `auto` is where nothing is timed: the backend's first candidate (chunked on CPU, the Pallas kernel on
    GPU, splash on TPU). The probe (`probe_auto`) keeps the fastest that runs instead."""
    return auto_candidates(backend)[0][0]
