"""A tandem app on a local Ray and Serve, on a free loopback port, for the benchmarks that go through HTTP."""
from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

import ray
from ray import serve

from cluster.config import ClusterConfig
from cluster.app import build_app, shutdown_cluster


@contextmanager
def serve_app(config: ClusterConfig) -> Iterator[str]:
    """Start Ray, Serve and the app of `config`; yields its base URL; tears all three down."""
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        # The apps first: their cluster controllers start the workers, which load while Serve starts.
        app = build_app(config)
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(app, name="bench", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        shutdown_cluster(config.name)
        ray.shutdown()
