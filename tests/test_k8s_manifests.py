"""The KubeRay manifests in k8s/ against the RayJob CRD schema (KubeRay 1.7, in ../shared/kuberay-crds), and
their entrypoint against our own config: a manifest that the API server accepts but whose job cannot start
would only fail inside the cluster."""

from __future__ import annotations

import copy
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from elastictrain import load_config

REPO = Path(__file__).resolve().parents[1]
CRDS = Path(__file__).resolve().parents[2] / "shared" / "kuberay-crds"
MANIFESTS = sorted((REPO / "k8s").glob("*.yaml"))


def _strip_extensions(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _strip_extensions(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if isinstance(node, list):
        return [_strip_extensions(v) for v in node]
    return node


def _closed(node: Any) -> Any:
    """A copy where every object schema that lists its properties rejects others. The CRD does not say
    additionalProperties: false, but the API server prunes (or, with strict field validation, rejects)
    unknown fields of a structural schema, so a misspelled field is lost either way."""
    if isinstance(node, list):
        return [_closed(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _closed(v) for k, v in node.items()}
    if ("properties" in node and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def crd_schema() -> dict[str, Any]:
    path = CRDS / "ray.io_rayjobs.yaml"
    if not path.is_file():
        pytest.skip(f"kuberay-crds not found beside the repo; expected {path} (see shared/kuberay-crds/SOURCE.md)")
    crd = yaml.safe_load(path.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return v1["schema"]["openAPIV3Schema"]


@pytest.fixture(scope="module")
def validator(crd_schema: dict[str, Any]) -> jsonschema.Draft7Validator:
    schema = _strip_extensions(crd_schema)
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


@pytest.fixture(scope="module")
def strict_validator(crd_schema: dict[str, Any]) -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(_strip_extensions(_closed(crd_schema)))


def _docs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in MANIFESTS:
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                out.append((f"{path.name}#{i}", doc))
    return out


DOCS = _docs()


def _errors(v: jsonschema.Draft7Validator, doc: dict[str, Any]) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in v.iter_errors(doc)]


def test_manifests_exist() -> None:
    names = {p.name for p in MANIFESTS}
    assert {"rayjob.yaml", "rayjob-gpu.yaml"} <= names
    assert all(doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayJob" for _, doc in DOCS)


@pytest.mark.parametrize(("name", "doc"), DOCS, ids=[n for n, _ in DOCS])
def test_manifest_matches_crd(name: str, doc: dict[str, Any], validator, strict_validator) -> None:
    assert _errors(validator, doc) == []
    assert _errors(strict_validator, doc) == [], f"{name} has fields the CRD does not know"


def _entrypoint(doc: dict[str, Any]) -> tuple[Path, list[str]]:
    argv = shlex.split(doc["spec"]["entrypoint"])
    assert argv[:4] == ["python", "-m", "elastictrain", "run"], argv
    job, rest = argv[4], argv[5:]
    overrides = []
    while rest:
        flag, value, *rest = rest
        assert flag == "--set", f"unexpected argument {flag!r} in the entrypoint"
        overrides.append(value)
    return REPO / job, overrides


@pytest.mark.parametrize(("name", "doc"), DOCS, ids=[n for n, _ in DOCS])
def test_entrypoint_job_validates(name: str, doc: dict[str, Any]) -> None:
    job, overrides = _entrypoint(doc)
    assert job.is_file(), f"{name}: entrypoint job file {job} is not in the repo"
    cfg = load_config(job, overrides)
    # A RayJob retry must resume: a stable run id plus resume=auto, checkpoints outside the cluster.
    assert cfg.checkpoint.resume == "auto"
    assert cfg.checkpoint.uri and cfg.checkpoint.uri.startswith("s3://")
    spec = doc["spec"]
    assert spec["backoffLimit"] >= 1 and spec["shutdownAfterJobFinishes"] is True
    assert spec["submissionMode"] == "K8sJobMode"
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert "elastictrain" in runtime_env["pip"]
    groups = spec["rayClusterSpec"]["workerGroupSpecs"]
    pods = sum(g["replicas"] for g in groups)
    assert pods >= cfg.workers.max, f"{name}: {pods} worker pods for workers.max={cfg.workers.max}"
    for g in groups:
        (container,) = g["template"]["spec"]["containers"]
        gpus = container["resources"]["limits"].get("nvidia.com/gpu", 0)
        assert (gpus >= 1) == cfg.workers.use_gpu, f"{name}: GPU limits disagree with workers.use_gpu"


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    rc = doc["spec"]["rayClusterSpec"]
    pods = [rc["headGroupSpec"]["template"]] + [g["template"] for g in rc["workerGroupSpecs"]]
    return [c for p in pods for c in p["spec"]["containers"]]


@pytest.mark.parametrize(("name", "doc"), DOCS, ids=[n for n, _ in DOCS])
def test_credentials_come_from_a_secret(name: str, doc: dict[str, Any]) -> None:
    for c in _containers(doc):
        assert any("secretRef" in e for e in c.get("envFrom", [])), f"{name}: {c['name']} has no secretRef"
        assert not [e for e in c.get("env", []) if e["name"].startswith("AWS_") and "value" in e]
        assert c["resources"]["requests"] and c["resources"]["limits"]


def test_validator_is_not_vacuous(validator, strict_validator) -> None:
    doc = copy.deepcopy(dict(DOCS)["rayjob.yaml#0"])
    typo = copy.deepcopy(doc)
    typo["spec"]["entrypont"] = typo["spec"].pop("entrypoint")
    # The CRD leaves additionalProperties open, so only the closed schema catches the typo.
    assert any("entrypont" in e for e in _errors(strict_validator, typo))
    bad_type = copy.deepcopy(doc)
    bad_type["spec"]["backoffLimit"] = "two"
    assert any(e.startswith("spec.backoffLimit") for e in _errors(validator, bad_type))
    nested = copy.deepcopy(doc)
    nested["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "2"
    assert _errors(validator, nested)
    missing = copy.deepcopy(doc)
    del missing["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["groupName"]
    assert any("groupName" in e for e in _errors(validator, missing))
