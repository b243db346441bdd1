"""S3 over real HTTP on loopback for the tests: moto's ThreadedMotoServer, as s3fs and
fsspec test themselves. Nothing leaves the machine.

    with s3_server() as s3:           # or the ``s3`` fixture from tests/conftest.py
        s3.make_bucket("corpus")
        fs = s3.filesystem()          # an s3fs.S3FileSystem against the server
        env = s3.environ              # AWS_* variables a child process needs

Each server starts empty. Inside the ``with`` the process's environment points at the server too
(AWS_ENDPOINT_URL, dummy credentials, us-east-1), so code that builds its own
client from the environment, as dlop does, reaches it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any


class S3Server:
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.environ = {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_SESSION_TOKEN": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_REGION": "us-east-1",
        }

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    def make_bucket(self, name: str) -> str:
        """Creates bucket ``name`` (if missing); returns ``s3://name``."""
        client = self.client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=name)
        return f"s3://{name}"

    def filesystem(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(
            key="testing",
            secret="testing",
            client_kwargs={"endpoint_url": self.endpoint, "region_name": "us-east-1"},
            use_listings_cache=False,
            skip_instance_cache=True,
        )

    def reset(self) -> None:
        """Empties the server (every bucket gone)."""
        import urllib.request

        urllib.request.urlopen(
            urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")
        ).read()


@contextlib.contextmanager
def s3_server() -> Iterator[S3Server]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    s3 = S3Server(f"http://{host}:{port}")
    s3.reset()  # moto keeps its buckets across server instances in one process
    saved = {k: os.environ.get(k) for k in s3.environ}
    os.environ.update(s3.environ)
    try:
        yield s3
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()
