"""Orbax on s3://: Orbax 0.12 builds TensorStore specs for gs:// and local paths only; this builds the gs:// spec
and swaps in TensorStore's own s3 driver."""

from __future__ import annotations

import functools
import os

from resformer_jax.storage.paths import StorageError


def _swap_gcs_for_s3(spec):
    """The kvstore spec with every gcs driver replaced by TensorStore's s3 driver (same bucket/path)."""
    if isinstance(spec, dict):
        out = {k: _swap_gcs_for_s3(v) for k, v in spec.items()}
        if out.get("driver") in ("gcs", "gcs_grpc"):
            out = {"driver": "s3", "bucket": out["bucket"], "path": out.get("path", "")}
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            if endpoint:
                out["endpoint"] = endpoint
            region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
            if region:
                out["aws_region"] = region
        return out
    if isinstance(spec, list):
        return [_swap_gcs_for_s3(v) for v in spec]
    return spec


def _s3_aware(build):
    @functools.wraps(build)
    def wrapped(directory, *args, **kwargs):
        d = os.fspath(directory)
        if not d.startswith("s3://"):
            return build(directory, *args, **kwargs)
        return _swap_gcs_for_s3(build("gs://" + d[len("s3://") :], *args, **kwargs))

    wrapped.resformer_s3 = True
    return wrapped


def orbax_s3_paths() -> None:
    """Lets Orbax write and read arrays under s3:// paths.

    Orbax 0.12 builds TensorStore kvstore specs with a `gcs` driver for gs:// and a `file` driver for
    everything else, so s3:// fails ("Checkpoint path should be absolute") although TensorStore has an
    s3 driver. This wraps Orbax's two spec builders once per process: an s3:// directory is built as
    its gs:// twin and the driver swapped. Orbax's own files (metadata, JSON items) already go through
    epath. Raises StorageError when the Orbax version lacks the builders (then s3:// is unsupported)."""
    try:
        from orbax.checkpoint._src.serialization import tensorstore_utils as tsu
    except ImportError as e:  # pragma: no cover - depends on the orbax version
        raise StorageError(
            f"this Orbax version has no tensorstore_utils ({e}); s3:// checkpoints are "
            "unsupported with it: use gs://, a local path or an s3 mount"
        ) from None
    for name in ("_build_ocdbt_kvstore_tspec", "_build_non_ocdbt_kvstore_tspec"):
        fn = getattr(tsu, name, None)
        if fn is None:
            raise StorageError(
                f"this Orbax version has no {name}; s3:// checkpoints are unsupported with it: "
                "use gs://, a local path or an s3 mount (mountpoint-s3)"
            )
        if not getattr(fn, "resformer_s3", False):
            setattr(tsu, name, _s3_aware(fn))
