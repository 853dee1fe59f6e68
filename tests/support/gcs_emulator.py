"""Starts gcp-storage-emulator for tests/storage/test_cloud.py: python tests/support/gcs_emulator.py PORT BUCKET.

One gap of the emulator (2026.7.19) is filled here: its media downloads do not send the `x-goog-generation`
header that the GCS JSON API sends and that TensorStore's gcs driver reads to make its conditional writes
(Orbax's OCDBT manifest). Without it TensorStore reports "Malformed StorageGeneration".
"""

import sys
import time

from gcp_storage_emulator.handlers import objects

_download = objects.download


def download(request, response, storage, *args, **kwargs):
    _download(request, response, storage, *args, **kwargs)
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    except Exception:
        return
    response["x-goog-generation"] = str(obj["generation"])
    response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))


objects.download = download  # before the server module builds its routes

from gcp_storage_emulator.server import create_server  # noqa: E402

if __name__ == "__main__":
    port, bucket = int(sys.argv[1]), sys.argv[2]
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket)
    server.start()
    try:
        while True:
            time.sleep(3600)
    finally:
        server.stop()
