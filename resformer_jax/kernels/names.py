"""The attention implementations by name: the one list the config validates against."""
import contextlib
import contextvars

# auto: resolved once at setup by probing at the run's shapes (train/setup.py).
# pallas: this project's flash attention (GPU, Triton); splash: JAX's TPU splash-attention kernel.
IMPLS = ("auto", "pallas", "cudnn", "splash", "chunked", "xla", "reference")

# The platform a program is being compiled for when it is not this machine's backend (train/aot.py compiles for
# TPU slices and GPUs from a CPU). The kernels read it to decide whether their interpreted (test) path is what
# will run; a context variable, so it holds only inside `compiling_for` and only in that thread.
_TARGET_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar("target_platform", default=None)


@contextlib.contextmanager
def compiling_for(platform: str):
    """Inside: programs are lowered for `platform` ('tpu' or 'cuda'), not for the local backend."""
    token = _TARGET_PLATFORM.set(platform)
    try:
        yield
    finally:
        _TARGET_PLATFORM.reset(token)


def target_backend() -> str:
    """The backend the program being traced will run on: the compile target inside `compiling_for`, else JAX's
    default backend ('gpu' for CUDA, as jax.default_backend() names it)."""
    import jax
    target = _TARGET_PLATFORM.get()
    return jax.default_backend() if target is None else backend_of(target)


def backend_of(platform: str) -> str:
    """A lowering platform ('cuda', 'rocm', 'tpu') as jax.default_backend() names its backend ('gpu', 'tpu')."""
    return "gpu" if platform in ("cuda", "rocm", "gpu") else platform
