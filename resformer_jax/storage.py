"""Run directories on local disk or object storage (gs://, s3://), through one path type.

Every path a command writes to or reads from goes through `run_path` (an
`etils.epath.Path`, the abstraction Orbax and grain use): local paths are `pathlib` paths, gs:// and
s3:// paths go through fsspec (gcsfs, s3fs). What object storage lacks is handled here once:

- no append: `LineLog` keeps metrics.jsonl's lines in segment objects (`metrics.jsonl.parts/`), each
  rewritten whole at every flush and closed after `SEGMENT_LINES` lines or when the process ends, so a
  preempted run loses at most the lines since its last flush (as a local file does);
- no rename: `write_text_atomic` relies on an object appearing whole when its upload ends;
- Orbax 0.12 builds TensorStore specs for gs:// and local paths only; `orbax_s3_paths` gives it s3://
  (TensorStore's own s3 driver) by building the gs:// spec and swapping the driver.

TensorBoard event files go through epath too (`tensorboard_writers_for`).

Emulators: gcsfs follows STORAGE_EMULATOR_HOST, TensorStore follows TENSORSTORE_GCS_HTTP_URL (and
GOOGLE_AUTH_TOKEN_FOR_TESTING); s3fs and TensorStore follow AWS_ENDPOINT_URL. tests/test_cloud.py runs real runs
against gcp-storage-emulator and moto's server.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import shutil

from etils import epath

from resformer_jax.errors import UserError

SEGMENT_LINES = 1000

# scheme -> (modules it needs, the pip extra that installs them)
_CLOUD_PACKAGES = {
    "gs": (("gcsfs",), "gcs"),
    "s3": (("s3fs",), "s3"),
}


class StorageError(UserError, ValueError):
    """A run path this installation cannot use; the message names the package and the extra."""


def scheme(path) -> str:
    """'gs', 's3', ... for a URL; '' for a local path."""
    s = os.fspath(path) if not isinstance(path, str) else path
    return s.split("://", 1)[0] if "://" in s else ""


def is_remote(path) -> bool:
    return scheme(path) != ""


def check_supported(path) -> None:
    """Raises StorageError naming the extra to install when `path`'s scheme needs a missing package."""
    sch = scheme(path)
    if not sch:
        return
    if sch not in _CLOUD_PACKAGES:
        raise StorageError(f"{path}: {sch}:// is not supported; use a local path, gs:// or s3://")
    modules, extra = _CLOUD_PACKAGES[sch]
    missing = [m for m in modules if not _importable(m)]
    if missing:
        raise StorageError(
            f"{path} needs {' and '.join(missing)} for {sch}:// paths; install them with "
            f"pip install -e '.[{extra}]' (the tpu and gpu extras include gcs)"
        )


class StorageAccessError(StorageError):
    """Object storage this process cannot use: no credentials, no network, an unknown host, refused credentials."""


PROBE_TIMEOUT_S = 5.0  # one TCP connect to the endpoint; the metadata server gets 1 s


def probe_access(path) -> None:
    """Before any work on a gs:// or s3:// path: are there credentials, and is the endpoint reachable? One probe
    with short timeouts (seconds, not the clients' minute-long retry storms); StorageAccessError names the real
    cause and what supplies the fix. Emulators (STORAGE_EMULATOR_HOST, AWS_ENDPOINT_URL) are probed the same way."""
    sch = scheme(path)
    if sch not in ("gs", "s3"):
        return
    bucket = os.fspath(path).split("://", 1)[1].split("/", 1)[0]
    problem = _probe(sch, bucket, *(os.environ.get(k, "") for k in _PROBE_ENV))
    if problem:
        raise StorageAccessError(f"{path}: {problem}")


# What a probe's outcome depends on (the outcome is cached per process for each combination).
_PROBE_ENV = (
    "STORAGE_EMULATOR_HOST",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "CLOUDSDK_CONFIG",
    "HOME",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ACCESS_KEY_ID",
    "AWS_PROFILE",
    "AWS_EC2_METADATA_DISABLED",
)


@functools.cache
def _probe(sch: str, bucket: str, *env) -> str | None:
    if sch == "gs":
        emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        endpoint = emulator or "https://storage.googleapis.com"
        if not emulator and not _gcp_credentials():
            return (
                "no Google Cloud credentials: set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file, "
                "or run `gcloud auth application-default login` (on a GCE or TPU VM the metadata server "
                "supplies them)"
            )
    else:
        endpoint = (
            os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "https://s3.amazonaws.com"
        )
        if not _aws_credentials():
            return (
                "no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or run "
                "`aws configure` / `aws sso login` (on EC2 an instance role supplies them)"
            )
        return _reachable(endpoint) or _s3_bucket_answers(bucket)
    return _reachable(endpoint)


def _s3_bucket_answers(bucket: str) -> str | None:
    """One HEAD request on the bucket with the credentials found (short timeouts, no retries): refused credentials
    and a missing bucket are named here, not after minutes of retries."""
    try:
        import botocore.config
        import botocore.exceptions
        import botocore.session
    except ImportError:
        return None
    client = botocore.session.get_session().create_client(
        "s3",
        config=botocore.config.Config(
            connect_timeout=PROBE_TIMEOUT_S, read_timeout=PROBE_TIMEOUT_S, retries={"max_attempts": 1}
        ),
    )
    try:
        client.head_bucket(Bucket=bucket)
    except botocore.exceptions.ClientError as e:
        code = str(e.response.get("Error", {}).get("Code", ""))
        if code in ("403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidClientTokenId"):
            return (
                f"the AWS credentials found are refused for bucket {bucket!r} ({code}): check AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY or AWS_PROFILE, and the bucket's permissions"
            )
        if code in ("404", "NoSuchBucket"):
            return f"the bucket {bucket!r} does not exist; create it first (aws s3 mb s3://{bucket})"
        return f"the bucket {bucket!r} does not answer ({code}: {e})"
    except botocore.exceptions.BotoCoreError as e:
        return f"the bucket {bucket!r} does not answer ({type(e).__name__}: {e})"
    return None


def _gcp_credentials() -> bool:
    key = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if key:
        return os.path.isfile(key)
    if os.environ.get("GOOGLE_AUTH_TOKEN_FOR_TESTING"):
        return True
    config = os.environ.get("CLOUDSDK_CONFIG") or os.path.join(os.path.expanduser("~"), ".config", "gcloud")
    if os.path.isfile(os.path.join(config, "application_default_credentials.json")):
        return True
    return _gce_metadata_server()


def _gce_metadata_server() -> bool:
    """Whether the GCE metadata server (which supplies a VM's credentials) answers, within 1 s."""
    import urllib.request

    req = urllib.request.Request("http://169.254.169.254/computeMetadata/v1/", headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(req, timeout=1.0) as r:
            return r.headers.get("Metadata-Flavor") == "Google"
    except Exception:
        return False


def _aws_credentials() -> bool:
    try:
        import botocore.session
    except ImportError:  # s3fs brings botocore; without it check_supported has already named the extra
        return bool(os.environ.get("AWS_ACCESS_KEY_ID"))
    session = botocore.session.get_session()
    # botocore's own chain (environment, profiles, SSO, web identity, containers, EC2 instance metadata): the
    # metadata lookup is bounded (1 s, one attempt) unless the user configured otherwise
    try:
        return session.get_credentials() is not None
    except Exception:
        return False


def _reachable(url: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None when a TCP connection to the URL's host opens within `timeout`; else why not, in words."""
    import socket
    from urllib.parse import urlparse

    u = urlparse(url if "://" in url else f"http://{url}")
    host, port = u.hostname or "", u.port or (443 if u.scheme == "https" else 80)
    try:
        addrs = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        return (
            f"cannot resolve the host {host!r} ({e.strerror if hasattr(e, 'strerror') else e}): no network, "
            "no DNS, or a wrong endpoint (check AWS_ENDPOINT_URL / STORAGE_EMULATOR_HOST if set)"
        )
    last = None
    for family, kind, proto, _, addr in addrs[:2]:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.settimeout(timeout)
                sock.connect(addr)
                return None
        except OSError as e:
            last = e
    why = "timed out" if isinstance(last, TimeoutError) else (getattr(last, "strerror", None) or str(last))
    return (
        f"cannot reach {host}:{port} ({why}): no network, a firewall or proxy in the way, or a wrong endpoint "
        "(check AWS_ENDPOINT_URL / STORAGE_EMULATOR_HOST if set)"
    )


def _importable(module: str) -> bool:
    import sys

    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ModuleNotFoundError, ValueError):
        return False


def run_path(path) -> epath.Path:
    """The path as an epath.Path (local paths made absolute), after checking its scheme is usable."""
    check_supported(path)
    s = os.fspath(path)
    return epath.Path(s if is_remote(s) else os.path.abspath(s))


def write_text_atomic(path, text: str) -> None:
    """Writes a file so a reader never sees half of it: a local rename, or an object upload (objects
    appear whole when the upload ends)."""
    p = epath.Path(path)
    if is_remote(p):
        p.write_text(text)
        return
    tmp = p.with_name(p.name + f".tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, p)


def write_json(path, obj, indent: int | None = 2) -> None:
    write_text_atomic(path, json.dumps(obj, indent=indent) + "\n")


def move_tree(src, dst) -> None:
    """Moves a directory (replacing `dst`); on object storage a copy of every object, then a delete."""
    src, dst = epath.Path(src), epath.Path(dst)
    if dst.exists():
        dst.rmtree()
    if not is_remote(src):
        shutil.move(os.fspath(src), os.fspath(dst))
        return
    for f in files_under(src):
        out = dst / f.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        f.copy(out)
    src.rmtree()


def files_under(root) -> list[epath.Path]:
    """Every file below `root`, sorted (epath's rglob is refused on gs://, so a walk of iterdir)."""
    out, todo = [], [epath.Path(root)]
    while todo:
        for p in todo.pop().iterdir():
            (todo if p.is_dir() else out).append(p)
    return sorted(out, key=str)


def copy_file(src, dst) -> None:
    epath.Path(src).copy(epath.Path(dst), overwrite=True)


class LineLog:
    """Appends lines to `path` and keeps them on a kill.

    Local: an appended file, flushed at each write. Object storage cannot append, so lines go to
    segment objects `path.parts/SSSSSS.jsonl`: each is rewritten whole at every write (an upload
    replaces an object atomically) and a new one starts after SEGMENT_LINES lines or when a new
    process opens the log, so no earlier segment is ever rewritten. `read_lines` reads both layouts.
    """

    def __init__(self, path):
        self.path = epath.Path(path)
        self.remote = is_remote(self.path)
        if not self.remote:
            self.f = open(self.path, "a")  # noqa: SIM115 - held open for the run, closed by close()
            return
        self.parts = _parts_dir(self.path)
        self.parts.mkdir(parents=True, exist_ok=True)
        self.segment = _next_segment(self.parts)
        self.lines: list[str] = []

    def write(self, line: str) -> None:
        line = line.rstrip("\n") + "\n"
        if not self.remote:
            self.f.write(line)
            self.f.flush()
            return
        self.lines.append(line)
        (self.parts / f"{self.segment:06d}.jsonl").write_text("".join(self.lines))
        if len(self.lines) >= SEGMENT_LINES:
            self.segment, self.lines = self.segment + 1, []

    def close(self) -> None:
        if not self.remote:
            self.f.close()


def _parts_dir(path: epath.Path) -> epath.Path:
    return path.with_name(path.name + ".parts")


def _next_segment(parts: epath.Path) -> int:
    nums = [int(p.stem) for p in parts.glob("*.jsonl") if p.stem.isdigit()]
    return max(nums) + 1 if nums else 0


def has_lines(path) -> bool:
    p = epath.Path(path)
    return p.is_file() or (_parts_dir(p).is_dir() and any(_parts_dir(p).glob("*.jsonl")))


def read_lines(path) -> list[str]:
    """Every line a LineLog wrote to `path`, in order (the plain file, then its segments)."""
    p = epath.Path(path)
    out = []
    if p.is_file():
        out += p.read_text().splitlines()
    parts = _parts_dir(p)
    if parts.is_dir():
        for seg in sorted(parts.glob("*.jsonl"), key=lambda q: q.name):
            out += seg.read_text().splitlines()
    return [ln for ln in out if ln.strip()]


# --- Orbax on s3:// ----------------------------------------------------------------------------------


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


def save_figure(fig, path, dpi: int = 100) -> None:
    """A matplotlib figure as PNG at `path` (local or object storage)."""
    with epath.Path(path).open("wb") as f:
        fig.savefig(f, format="png", dpi=dpi)


@contextlib.contextmanager
def staged_dir(out):
    """A local folder to write into for libraries that write local files only (safetensors); when `out` is
    on object storage its files are uploaded after the block succeeds (nothing is uploaded on an error)."""
    if not is_remote(out):
        os.makedirs(out, exist_ok=True)
        yield os.fspath(out)
        return
    check_supported(out)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        yield d
        dst = epath.Path(out)
        # config.json last: a folder whose upload stopped part-way never looks like a finished model
        for f in sorted(files_under(d), key=lambda f: f.name == "config.json"):
            target = dst / f.relative_to(d)
            target.parent.mkdir(parents=True, exist_ok=True)
            f.copy(target, overwrite=True)


# --- TensorBoard event files on object storage ----------------------------------------------------------


class _ObjectRecordWriter:
    """An event file on object storage: the bytes written so far, uploaded whole at each flush (objects cannot
    be appended to); nothing is uploaded again after close."""

    def __init__(self, path: str):
        import io

        self.path, self.buffer, self.dirty, self.closed = epath.Path(path), io.BytesIO(), False, False

    def write(self, data: bytes):
        self.buffer.write(data)
        self.dirty = True

    def flush(self):
        if self.dirty and not self.closed:
            self.path.write_bytes(self.buffer.getvalue())
            self.dirty = False

    def close(self):
        self.flush()
        self.closed = True


class _ObjectWriterFactory:
    def open(self, path):
        return _ObjectRecordWriter(path)

    def directory_check(self, path):
        pass  # object storage has no folders to create


def tensorboard_writers_for(logdir) -> None:
    """Has tensorboardX write `logdir`'s event files through epath when it is on object storage.

    tensorboardX's own gs:// and s3:// writers need google-cloud-storage / boto3 and upload the file again from
    their __del__ after close (at interpreter exit, with retries that last minutes when storage is gone); this
    registers one writer for both schemes through tensorboardX's `register_writer_factory`."""
    sch = scheme(logdir)
    if sch:
        check_supported(logdir)
        from tensorboardX import record_writer

        record_writer.register_writer_factory(sch, _ObjectWriterFactory())
