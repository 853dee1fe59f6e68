"""TensorBoard event files on object storage: each uploaded whole at every flush."""

from __future__ import annotations

import io

from etils import epath

from resformer_jax.storage.paths import check_supported, scheme


class _ObjectRecordWriter:
    """An event file on object storage: the bytes written so far, uploaded whole at each flush (objects cannot
    be appended to); nothing is uploaded again after close."""

    def __init__(self, path: str):
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
