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
from collections.abc import Iterator
from typing import Any

from dlop.tools.bench.remote_bench import moto_environ, moto_server


class S3Server:
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.environ = moto_environ(endpoint)
        self.key = self.environ["AWS_ACCESS_KEY_ID"]
        self.secret = self.environ["AWS_SECRET_ACCESS_KEY"]

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=self.key,
            aws_secret_access_key=self.secret,
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
            key=self.key,
            secret=self.secret,
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
    """The tool's moto server (dlop.tools.bench.remote_bench.moto_server) as an S3Server."""
    with moto_server() as endpoint:
        yield S3Server(endpoint)
