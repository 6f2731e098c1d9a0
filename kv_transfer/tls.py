"""TLS for the gRPC KV transport: credentials from PEM files, checked when a server or client is built.

`transfer.tls` names this worker's certificate and key and the CA that signed its peers'. A KV server then
serves TLS only (a plaintext client is refused); a client verifies the server's certificate against the CA
(`server_name` when certificates name a host other than the address dialled). With `mutual`, servers also
require a client certificate signed by the CA. The torch.distributed data plane is not encrypted.
"""
from __future__ import annotations

from pathlib import Path

import grpc

from kv_transfer.config import TLSFiles


def read_pem(path: str | None, what: str) -> bytes | None:
    """The file's bytes, or an error that names the setting and the file."""
    if path is None:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"transfer.tls.{what}: cannot read {path!r}: {err.strerror or err}") from None
    if b"-----BEGIN" not in data:
        raise ValueError(f"transfer.tls.{what}: {path!r} is not a PEM file")
    return data


def check_files(tls: TLSFiles) -> None:
    """Raise ValueError naming the first TLS file that is missing, unreadable or not PEM."""
    for what in ("cert_file", "key_file", "ca_file"):
        read_pem(getattr(tls, what), what)
    if tls.mutual and tls.ca_file is None:
        raise ValueError("transfer.tls.mutual needs transfer.tls.ca_file to verify client certificates")


def server_credentials(tls: TLSFiles) -> grpc.ServerCredentials:
    check_files(tls)
    pair = (read_pem(tls.key_file, "key_file"), read_pem(tls.cert_file, "cert_file"))
    return grpc.ssl_server_credentials([pair], root_certificates=read_pem(tls.ca_file, "ca_file") if tls.mutual else None,
                                      require_client_auth=tls.mutual)


def channel_credentials(tls: TLSFiles) -> grpc.ChannelCredentials:
    check_files(tls)
    if tls.mutual:
        return grpc.ssl_channel_credentials(read_pem(tls.ca_file, "ca_file"), read_pem(tls.key_file, "key_file"),
                                            read_pem(tls.cert_file, "cert_file"))
    return grpc.ssl_channel_credentials(read_pem(tls.ca_file, "ca_file"))
