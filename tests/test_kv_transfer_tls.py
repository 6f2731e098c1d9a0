"""TLS on the gRPC KV transport, with a self-signed CA made by the test: pulls over TLS are exact, plaintext
and untrusted clients are refused, mutual TLS turns away clients without a certificate, and bad files
fail at start with the setting named."""
from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from engine.kv_cache import KVCache
from kv_transfer.config import TLSFiles
from kv_transfer import KVServerConfig, KVTransferError, KVTransferServer
from kv_transfer.grpc_client import GrpcKVClient
from protos import kv_transfer_pb2 as pb
from protos.kv_transfer_pb2_grpc import KVTransferStub
from tests.test_kv_transfer import LAYOUT, TOKEN, Released, assert_blocks_equal, random_cache


def _write(path: Path, key, cert) -> tuple[str, str]:
    path.with_suffix(".key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path.with_suffix(".crt")), str(path.with_suffix(".key"))


def _cert(name: str, key, issuer_name, issuer_key, ca: bool):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
               .issuer_name(issuer_name or x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


def make_ca(directory: Path, name: str) -> dict[str, str]:
    """A self-signed CA and a certificate it signed for 127.0.0.1 / localhost: {ca, cert, key} paths."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _cert(f"{name} CA", ca_key, None, None, ca=True)
    ca_file, _ = _write(directory / f"{name}-ca", ca_key, ca_cert)
    key = ec.generate_private_key(ec.SECP256R1())
    cert_file, key_file = _write(directory / name, key, _cert(name, key, ca_cert.subject, ca_key, ca=False))
    return {"ca": ca_file, "cert": cert_file, "key": key_file}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    return make_ca(directory, "cluster"), make_ca(directory, "stranger")


@pytest.fixture
def made():
    peers = []
    yield peers
    for peer in reversed(peers):
        peer.close() if hasattr(peer, "close") else peer.stop()


def tls(files: dict[str, str], **options) -> TLSFiles:
    return TLSFiles(cert_file=files["cert"], key_file=files["key"], ca_file=files["ca"], **options)


def serve(made, files, **options):
    src = random_cache()
    server = KVTransferServer(src, TOKEN, KVServerConfig(tls=tls(files, **options))).start()
    made.append(server)
    return src, server, server.lease("req", [3, 9, 4], [], 40, Released())


def client(made, files=None, **options) -> GrpcKVClient:
    c = GrpcKVClient(KVCache(LAYOUT, 16), TOKEN, timeout_s=10, tls=tls(files, **options) if files else None)
    made.append(c)
    return c


def test_a_pull_over_tls_is_exact(made, pki):
    cluster, _ = pki
    src, _, handle = serve(made, cluster)
    puller = client(made, cluster)
    puller.pull(handle, [0, 1, 2], [0, 1, 2])
    assert_blocks_equal(src, [3, 9, 4], puller.cache, [0, 1, 2])
    assert puller.release(handle) is True


def test_a_plaintext_client_is_refused(made, pki):
    cluster, _ = pki
    _, server, handle = serve(made, cluster)
    with pytest.raises(KVTransferError):
        client(made).pull(handle, [0, 1, 2], [0, 1, 2])
    with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError) as err:
        KVTransferStub(channel).Health(pb.HealthRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),),
                                       timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert server.leases.num_active_pulls == 0 and len(server.leases) == 1  # nothing was read


def test_a_client_that_trusts_another_ca_is_refused(made, pki):
    cluster, stranger = pki
    _, _, handle = serve(made, cluster)
    with pytest.raises(KVTransferError):
        client(made, {**cluster, "ca": stranger["ca"]}).pull(handle, [0, 1, 2], [0, 1, 2])


def test_mutual_tls_refuses_clients_without_a_certificate_from_the_ca(made, pki):
    cluster, stranger = pki
    src, _, handle = serve(made, cluster, mutual=True)
    with pytest.raises(KVTransferError):
        client(made, cluster).pull(handle, [0, 1, 2], [0, 1, 2])  # verifies the server, shows no certificate
    with pytest.raises(KVTransferError):
        client(made, {**stranger, "ca": cluster["ca"]}, mutual=True).pull(handle, [0, 1, 2], [0, 1, 2])
    puller = client(made, cluster, mutual=True)
    puller.pull(handle, [0, 1, 2], [0, 1, 2])
    assert_blocks_equal(src, [3, 9, 4], puller.cache, [0, 1, 2])


def test_a_certificate_for_another_name_is_accepted_with_server_name(made, pki):
    cluster, _ = pki
    src, _, handle = serve(made, cluster)
    puller = client(made, cluster, server_name="localhost")
    puller.pull(handle, [0, 1, 2], [0, 1, 2])
    assert_blocks_equal(src, [3, 9, 4], puller.cache, [0, 1, 2])


@pytest.mark.parametrize("what", ["cert", "key", "ca"])
def test_missing_unreadable_or_non_pem_files_fail_at_start_naming_the_setting(pki, tmp_path, what):
    cluster, _ = pki
    (tmp_path / "notes.txt").write_text("not a certificate")
    for bad, message in [(str(tmp_path / "absent.pem"), "cannot read"), (str(tmp_path), "cannot read"),
                         (str(tmp_path / "notes.txt"), "not a PEM file")]:
        with pytest.raises(ValueError, match=f"transfer.tls.{what}_file: .*{message}"):
            KVTransferServer(random_cache(), TOKEN, KVServerConfig(tls=tls({**cluster, what: bad}, mutual=True)))
        with pytest.raises(ValueError, match=f"transfer.tls.{what}_file"):
            GrpcKVClient(KVCache(LAYOUT, 4), TOKEN, tls=tls({**cluster, what: bad}, mutual=True))
