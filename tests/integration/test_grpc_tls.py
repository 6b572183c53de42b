"""Issue 16, item 7: TLS and mTLS on gRPC from ``OPML_GRPC_TLS_*``, with certificates this test makes
(openssl), on real service processes: a TLS server serves a client that trusts its CA (the Python
client and the CLI), refuses a plaintext client and one that trusts another CA; with mTLS it refuses a
client without a certificate or with one another CA signed; and the whole serving path runs over
mTLS: router -> bundle-store (the bundle fetch), router -> worker (the control calls), client ->
router (inference, on the router's port and on its native front's)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton
import yaml
from opml.inference.v1 import deployments_pb2 as pb
from tritonclient.utils import InferenceServerException

from opml_bundle_store_contract.client import BundleStoreClient
from opml_common.config import GrpcTlsSettings
from opml_common.errors import NotFound, Unavailable
from opml_devstack.testing.bus import poll_until
from opml_devstack.testing.services import TOKENS
from opml_inference_router.testing import mlp_config, write_model_dir
from opml_inference_router_contract.client import DeploymentClient


def _openssl(*args: str, cwd: Path) -> None:
    """The certificates are made with the openssl command, which `make install` installs: missing, the
    test fails with that reason instead of skipping."""
    assert shutil.which("openssl"), "openssl is not on PATH (`make install` installs it: apt-get install openssl)"
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(directory: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=directory)


def _leaf(directory: Path, name: str, ca: str, extensions: str) -> None:
    (directory / f"{name}.ext").write_text(extensions)
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=directory)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=directory)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ca (signs server and client), rogue (another CA, signs rogue-client); keys beside certs."""
    directory = tmp_path_factory.mktemp("pki")
    _ca(directory, "ca")
    _ca(directory, "rogue")
    _leaf(directory, "server", "ca", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    _leaf(directory, "client", "ca", "extendedKeyUsage=clientAuth\n")
    _leaf(directory, "rogue-client", "rogue", "extendedKeyUsage=clientAuth\n")
    return directory


def _server_env(pki: Path, *, mtls: bool) -> dict[str, str]:
    """A service's TLS variables: its server certificate and, as a client (its health probe, its calls
    to other services), the CA and (mTLS) its client certificate."""
    env = {"OPML_GRPC_TLS_CERT": str(pki / "server.pem"), "OPML_GRPC_TLS_KEY": str(pki / "server.key"),
           "OPML_GRPC_TLS_CA": str(pki / "ca.pem")}
    if mtls:
        env |= {"OPML_GRPC_TLS_CLIENT_CA": str(pki / "ca.pem"), "OPML_GRPC_TLS_CLIENT_CERT": str(pki / "client.pem"),
                "OPML_GRPC_TLS_CLIENT_KEY": str(pki / "client.key")}
    return env


def _client_tls(pki: Path, ca: str = "ca", cert: str | None = None) -> GrpcTlsSettings:
    return GrpcTlsSettings(grpc_tls_ca=pki / f"{ca}.pem",
                           grpc_tls_client_cert=pki / f"{cert}.pem" if cert else None,
                           grpc_tls_client_key=pki / f"{cert}.key" if cert else None)


def _contexts(target: str, tls) -> list[str]:
    with BundleStoreClient(target, token=TOKENS["reader"], tls=tls) as client:
        return [c.name for c in client.list_contexts()]


def test_a_tls_server_serves_clients_that_trust_its_ca_and_refuses_the_rest(start_service, pki, opml_cli,
                                                                             monkeypatch) -> None:
    store = start_service("bundle-store", extra_env=_server_env(pki, mtls=False))
    with BundleStoreClient(store.target, token=TOKENS["writer"], tls=_client_tls(pki)) as client:
        client.create_context("tls")
    assert _contexts(store.target, _client_tls(pki)) == ["contexts/tls"]
    with pytest.raises(Unavailable):
        _contexts(store.target, False)  # plaintext: the TLS port fails the handshake
    with pytest.raises(Unavailable):
        _contexts(store.target, _client_tls(pki, ca="rogue"))  # a server this client cannot verify

    monkeypatch.setenv("OPML_BUNDLE_STORE_TARGET", store.target)
    assert "tls" in opml_cli("bundle", "--tls-ca", str(pki / "ca.pem"), "context", "ls", token="reader")
    monkeypatch.setenv("OPML_GRPC_TLS_CA", str(pki / "ca.pem"))  # the same from the environment
    assert "tls" in opml_cli("bundle", "context", "ls", token="reader")


def test_mtls_refuses_a_client_without_a_certificate_the_ca_signed(start_service, pki) -> None:
    store = start_service("bundle-store", extra_env=_server_env(pki, mtls=True))
    assert _contexts(store.target, _client_tls(pki, cert="client")) == []
    with pytest.raises(Unavailable):
        _contexts(store.target, _client_tls(pki))  # TLS, but no client certificate
    with pytest.raises(Unavailable):
        _contexts(store.target, _client_tls(pki, cert="rogue-client"))
    with pytest.raises(Unavailable):
        _contexts(store.target, False)


FLEET = {
    "pool_kinds": [{"name": "cpu", "precisions": ["fp32"], "memory_mib": 2048, "slots": 2, "cost_per_hour": 0.4,
                    "execution_provider": "CPUExecutionProvider"}],
    "pools": [{"name": "cpu", "kind": "cpu", "workers": 1}],
}


def test_the_serving_path_runs_over_mtls(start_service, pki, tmp_path: Path) -> None:
    """The router fetches the bundle from the store, loads it on its worker (a TCP gRPC server of its
    own, with the same variables) and answers inference, every hop over mTLS."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(FLEET))
    tls_env = _server_env(pki, mtls=True)
    store = start_service("bundle-store", extra_env=tls_env)
    router = start_service("inference-router", extra_env={
        **tls_env, "OPML_INFERENCE_ROUTER_FLEET": str(fleet),
        "OPML_INFERENCE_ROUTER_BUNDLE_STORE_TARGET": store.target,
        "OPML_INFERENCE_ROUTER_BUNDLE_STORE_TOKEN": TOKENS["reader"],
        "OPML_INFERENCE_ROUTER_WORKER_THREADS_PER_REPLICA": "1"})
    model_dir = write_model_dir(tmp_path / "mlp", mlp_config("mlp", pool_kinds=("cpu",), precisions=("fp32",)))
    tls = _client_tls(pki, cert="client")
    with BundleStoreClient(store.target, token=TOKENS["writer"], tls=tls) as client:
        client.create_context("serving")
        client.add("serving", "mlp", {"model.onnx": model_dir / "model.onnx", "model.yaml": model_dir / "model.yaml"},
                   tags={"serve": "true"}, commit=True)

    def serving(deployments: DeploymentClient) -> bool:
        try:
            return any(v.state == pb.SERVING for v in deployments.get("mlp").versions)
        except NotFound:
            return False

    with DeploymentClient(router.target, token=TOKENS["reader"], tls=tls) as deployments:
        poll_until(lambda: serving(deployments), timeout_s=60, what="mlp serving")
    assert _infer(router.target, pki, "client").shape[0] == 2
    # The router's inference port (its native front) serves the same mTLS from the same variables.
    inference = f"127.0.0.1:{router.env['OPML_INFERENCE_ROUTER_INFERENCE_PORT']}"
    assert _infer(inference, pki, "client").shape[0] == 2
    for refused in (None, "rogue-client"):  # no client certificate; one another CA signed
        with pytest.raises(InferenceServerException) as caught:
            _infer(inference, pki, refused)
        assert caught.value.status() == "StatusCode.UNAVAILABLE"


def _infer(target: str, pki: Path, cert: str | None) -> np.ndarray:
    """Scores of two rows of mlp over TLS (the client trusting ``ca``), with client certificate ``cert``."""
    data = np.zeros((2, 16), dtype=np.float32)
    certificate = {"private_key": str(pki / f"{cert}.key"), "certificate_chain": str(pki / f"{cert}.pem")} if cert else {}
    with triton.InferenceServerClient(target, ssl=True, root_certificates=str(pki / "ca.pem"), **certificate) as client:
        tensor = triton.InferInput("features", list(data.shape), "FP32")
        tensor.set_data_from_numpy(data)
        return client.infer("mlp", [tensor], headers={"authorization": f"Bearer {TOKENS['writer']}"},
                            client_timeout=30).as_numpy("scores")
