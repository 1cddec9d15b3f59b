"""A moto S3 server on loopback for the weightvault.dcp tests (one bucket per use)."""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@contextlib.contextmanager
def moto_s3(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(url, storage options)`` of a fresh bucket; the credentials are in the environment
    too, so spawned ranks inherit them."""
    s3fs = pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    for k, v in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
    }.items():
        monkeypatch.setenv(k, v)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {
        "client_kwargs": {"endpoint_url": f"http://{host}:{port}"},
        "key": "testing",
        "secret": "testing",
    }
    bucket = f"dcp-{uuid.uuid4().hex[:10]}"
    s3fs.S3FileSystem(**options).mkdir(bucket)
    try:
        yield f"s3://{bucket}/run", options
    finally:
        server.stop()
