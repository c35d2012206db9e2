"""The KubeRay manifests in k8s/ (KubeRay 1.7, ray.io/v1): strictly against the CRDs' openAPIV3Schema (in
../shared/kuberay-crds), against the KubeRay controller's own rules, core objects and every pod template with
kubernetes-validate, and their entrypoints against our own config: a manifest that the API server accepts but
whose job cannot start, or that drifts from its sibling, would only fail inside the cluster."""

from __future__ import annotations

import copy
import os
import re
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from elastictrain import load_config
from elastictrain.jobenv import RUN_ID_ENV, resolve_run_id

REPO = Path(__file__).resolve().parents[1]
# CI: ../shared/kuberay-crds beside the checkout; KUBERAY_CRDS points elsewhere (e.g. from a git worktree).
CRDS = Path(os.environ.get("KUBERAY_CRDS") or Path(__file__).resolve().parents[2] / "shared" / "kuberay-crds")
MANIFESTS = sorted((REPO / "k8s").glob("*.yaml"))
CRD_FILES = {"RayJob": "ray.io_rayjobs.yaml", "RayCluster": "ray.io_rayclusters.yaml"}
# KubeRay's validation (ray-operator/controllers/ray/utils/validation.go): DNS-1035 names, at most 53
# characters for a RayCluster (its services add suffixes) and 47 for a RayJob (its cluster adds 6).
MAX_NAME = {"RayCluster": 53, "RayJob": 47}
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
PAIRS = [("raycluster-gpu.yaml", "rayjob-gpu.yaml"), ("raycluster-cpu.yaml", "rayjob.yaml")]


# the same safe loader, in C where PyYAML was built with libyaml (~7x faster on the CRDs)
_SAFE = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


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


def _docs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in MANIFESTS:
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                out.append((f"{path.name}#{i}", doc))
    return out


DOCS = _docs()
RAY_DOCS = [(n, d) for n, d in DOCS if d["apiVersion"] == "ray.io/v1"]
CORE_DOCS = [(n, d) for n, d in DOCS if d["apiVersion"] != "ray.io/v1"]
JOBS = [(n, d) for n, d in RAY_DOCS if d["kind"] == "RayJob"]


def _doc(name: str) -> dict[str, Any]:
    return dict(DOCS)[name if "#" in name else f"{name}#0"]


@pytest.fixture(scope="module")
def validators() -> dict[str, tuple[jsonschema.Draft7Validator, jsonschema.Draft7Validator]]:
    out = {}
    for kind, filename in CRD_FILES.items():
        path = CRDS / filename
        if not path.is_file():
            pytest.skip(f"kuberay-crds not found beside the repo; expected {path} (see shared/kuberay-crds/SOURCE.md)")
        crd = yaml.load(path.read_text(), Loader=_SAFE)  # 2.3 MB of YAML: libyaml's loader when there is one
        (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
        schema = v1["schema"]["openAPIV3Schema"]
        open_schema = _strip_extensions(schema)
        jsonschema.Draft7Validator.check_schema(open_schema)
        out[kind] = (jsonschema.Draft7Validator(open_schema), jsonschema.Draft7Validator(_strip_extensions(_closed(schema))))
    return out


def _errors(v: jsonschema.Draft7Validator, doc: dict[str, Any]) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in v.iter_errors(doc)]


def _cluster_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]


def _pod_specs(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    rc = _cluster_spec(doc)
    pods = [("head", rc["headGroupSpec"]["template"]["spec"])]
    pods += [(g["groupName"], g["template"]["spec"]) for g in rc["workerGroupSpecs"]]
    if doc["kind"] == "RayJob" and "submitterPodTemplate" in doc["spec"]:
        pods.append(("submitter", doc["spec"]["submitterPodTemplate"]["spec"]))
    return pods


def test_manifests_exist() -> None:
    names = {p.name for p in MANIFESTS}
    assert {"rayjob.yaml", "rayjob-gpu.yaml", "raycluster-gpu.yaml", "raycluster-cpu.yaml", "serviceaccount.yaml",
            "fsx-lustre.yaml"} <= names
    assert {d["kind"] for _, d in RAY_DOCS} == {"RayJob", "RayCluster"}


@pytest.mark.parametrize(("name", "doc"), RAY_DOCS, ids=[n for n, _ in RAY_DOCS])
def test_manifest_matches_crd(name: str, doc: dict[str, Any], validators) -> None:
    loose, strict = validators[doc["kind"]]
    assert _errors(loose, doc) == []
    assert _errors(strict, doc) == [], f"{name} has fields the CRD does not know"


@pytest.mark.parametrize(("name", "doc"), RAY_DOCS, ids=[n for n, _ in RAY_DOCS])
def test_kuberay_controller_rules(name: str, doc: dict[str, Any]) -> None:
    meta_name = doc["metadata"]["name"]
    assert len(meta_name) <= MAX_NAME[doc["kind"]] and DNS1035.match(meta_name), meta_name
    rc = _cluster_spec(doc)
    groups = rc["workerGroupSpecs"]
    assert len({g["groupName"] for g in groups}) == len(groups), "worker group names must be unique"
    for g in groups:
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"], g["groupName"]
    for params in [rc["headGroupSpec"]["rayStartParams"]] + [g["rayStartParams"] for g in groups]:
        assert all(isinstance(v, str) for v in params.values()), f"rayStartParams values must be strings: {params}"
    assert rc["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # the head runs the driver only
    assert rc["enableInTreeAutoscaling"] is True and rc["autoscalerOptions"]["version"] == "v2"
    assert rc["headGroupSpec"]["template"]["spec"]["containers"][0]["name"] == "ray-head"
    if doc["kind"] == "RayJob":
        spec = doc["spec"]
        assert "clusterSelector" not in spec  # shutdownAfterJobFinishes needs a cluster the RayJob owns
        assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] > 0
        assert spec["backoffLimit"] >= 1 and spec["activeDeadlineSeconds"] > 0
        assert spec["submissionMode"] == "K8sJobMode"


@pytest.mark.parametrize(("name", "doc"), RAY_DOCS, ids=[n for n, _ in RAY_DOCS])
def test_the_gcs_declares_a_lost_node_dead_within_seconds(name: str, doc: dict[str, Any]) -> None:
    """The head's GCS health checks (Ray reads RAY_<setting> from the head's env): a node lost without a
    word is declared dead after failure_threshold x (period + timeout) at most -- at most 12 s here, not
    Ray's default 5 x (3 s + 10 s) (docs/design.md, "The control plane at scale")."""
    head = _cluster_spec(doc)["headGroupSpec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in head["env"]}
    period, timeout, threshold = (int(env[f"RAY_health_check_{k}"])
                                  for k in ("period_ms", "timeout_ms", "failure_threshold"))
    assert threshold * (period + timeout) <= 12_000 and timeout <= period and threshold >= 3


@pytest.mark.parametrize(("cluster", "rayjob"), PAIRS)
def test_rayjob_runs_on_the_raycluster_spec(cluster: str, rayjob: str) -> None:
    assert _doc(rayjob)["spec"]["rayClusterSpec"] == _doc(cluster)["spec"], f"{rayjob} drifted from {cluster}"


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


@pytest.mark.parametrize(("name", "doc"), JOBS, ids=[n for n, _ in JOBS])
def test_entrypoint_job_validates_and_fits_the_cluster(name: str, doc: dict[str, Any]) -> None:
    job, overrides = _entrypoint(doc)
    assert job.is_file(), f"{name}: entrypoint job file {job} is not in the repo"
    runtime_env = yaml.safe_load(doc["spec"]["runtimeEnvYAML"])
    # The code comes from the image: never a package from a public index, nor a working_dir to download.
    assert set(runtime_env) == {"env_vars"}, runtime_env
    cfg = resolve_run_id(load_config(job, overrides), runtime_env["env_vars"])
    # A RayJob retry (a fresh cluster, a new submission id) must resume the same run.
    assert cfg.run_id == runtime_env["env_vars"][RUN_ID_ENV]
    assert cfg.checkpoint.resume == "auto" and cfg.checkpoint.uri.startswith("s3://")
    groups = doc["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    per_pod = []
    for g in groups:
        (container,) = g["template"]["spec"]["containers"]
        gpus = int(container["resources"]["limits"].get("nvidia.com/gpu", 0))
        assert (gpus >= 1) == cfg.workers.use_gpu, f"{name}: GPU limits disagree with workers.use_gpu"
        per_pod.append(gpus if gpus else int(float(g["rayStartParams"]["num-cpus"]) // cfg.workers.cpus_per_worker))
    assert sum(g["minReplicas"] * n for g, n in zip(groups, per_pod)) == cfg.workers.min
    assert sum(g["maxReplicas"] * n for g, n in zip(groups, per_pod)) == cfg.workers.max
    head = doc["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    stop_wait = {e["name"]: e.get("value") for e in head["containers"][0].get("env", [])}["RAY_JOB_STOP_WAIT_TIME_S"]
    assert int(stop_wait) < head["terminationGracePeriodSeconds"]


def _containers(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    return [(pod, spec, c) for pod, spec in _pod_specs(doc) for c in spec["containers"]]


@pytest.mark.parametrize(("name", "doc"), RAY_DOCS, ids=[n for n, _ in RAY_DOCS])
def test_containers_are_non_root_with_minimal_capabilities(name: str, doc: dict[str, Any]) -> None:
    for pod, spec, c in _containers(doc):
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"], (pod, c["name"])
        added = sc["capabilities"].get("add", [])
        gpu = "nvidia.com/gpu" in c.get("resources", {}).get("limits", {})
        assert added == (["IPC_LOCK"] if gpu else []), f"{name} {pod}: capabilities {added} (RDMA only on GPU workers)"
        assert c["resources"]["requests"] and c["resources"]["limits"]
        assert not c["image"].startswith("rayproject/"), "the image must contain elastictrain (see Dockerfile)"
    ao = _cluster_spec(doc)["autoscalerOptions"]["securityContext"]
    assert ao["runAsNonRoot"] is True and ao["capabilities"]["drop"] == ["ALL"]


@pytest.mark.parametrize(("name", "doc"), RAY_DOCS, ids=[n for n, _ in RAY_DOCS])
def test_s3_credentials_from_a_secret_or_irsa(name: str, doc: dict[str, Any]) -> None:
    irsa = {d["metadata"]["name"] for _, d in CORE_DOCS
            if d["kind"] == "ServiceAccount" and "eks.amazonaws.com/role-arn" in d["metadata"].get("annotations", {})}
    for pod, spec, c in _containers(doc):
        assert not [e for e in c.get("env", []) if e["name"].startswith("AWS_")], f"{name} {pod}: inline AWS_*"
        if pod == "submitter":
            continue  # submits the job over HTTP; needs no storage access
        from_secret = any("secretRef" in e for e in c.get("envFrom", []))
        assert from_secret or spec.get("serviceAccountName") in irsa, f"{name} {pod}: no S3 credentials"


@pytest.mark.parametrize("name", ["raycluster-gpu.yaml", "rayjob-gpu.yaml"])
def test_gpu_cluster_shape(name: str) -> None:
    doc = _doc(name)
    pvcs = {d["metadata"]["name"] for _, d in CORE_DOCS if d["kind"] == "PersistentVolumeClaim"}
    for pod, spec in _pod_specs(doc):
        if pod == "submitter":
            continue
        claims = {v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"] if "persistentVolumeClaim" in v}
        assert claims & pvcs, f"{pod} does not mount the Lustre PVC"
    (group,) = _cluster_spec(doc)["workerGroupSpecs"]
    spec = group["template"]["spec"]
    (c,) = spec["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert any(k in c["resources"]["limits"] for k in ("vpc.amazonaws.com/efa", "rdma/rdma_shared_device_a"))
    assert spec["tolerations"] and spec["nodeSelector"]
    (shm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"mountPath": "/dev/shm", "name": "dshm"} in c["volumeMounts"]
    assert {p["name"] for p in c["ports"]} >= {"metrics"} and group["rayStartParams"]["metrics-export-port"]


def test_no_manifest_installs_from_a_public_index() -> None:
    for path in MANIFESTS:
        text = path.read_text()
        assert "pip:" not in text and "pip install" not in text, path.name


@pytest.fixture(scope="module")
def kubernetes_validate():
    return pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed (test extra)")


def _k8s_errors(kv: Any, doc: dict[str, Any]) -> list[str]:
    try:
        kv.validate(doc, kv.latest_version(), strict=True)
    except kv.ValidationError as e:
        return [str(e).splitlines()[0]]
    return []


@pytest.mark.parametrize(("name", "doc"), CORE_DOCS, ids=[n for n, _ in CORE_DOCS])
def test_core_objects_validate(name: str, doc: dict[str, Any], kubernetes_validate) -> None:
    assert _k8s_errors(kubernetes_validate, doc) == []


@pytest.mark.parametrize(("name", "doc"), RAY_DOCS, ids=[n for n, _ in RAY_DOCS])
def test_pod_templates_validate_as_pods(name: str, doc: dict[str, Any], kubernetes_validate) -> None:
    for pod, spec in _pod_specs(doc):
        as_pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"x-{pod}"}, "spec": spec}
        assert _k8s_errors(kubernetes_validate, as_pod) == [], f"{name} {pod}"


def test_validators_are_not_vacuous(validators, kubernetes_validate) -> None:
    loose, strict = validators["RayJob"]
    doc = copy.deepcopy(_doc("rayjob.yaml"))
    typo = copy.deepcopy(doc)
    typo["spec"]["entrypont"] = typo["spec"].pop("entrypoint")
    # The CRD leaves additionalProperties open, so only the closed schema catches the typo.
    assert any("entrypont" in e for e in _errors(strict, typo))
    bad_type = copy.deepcopy(doc)
    bad_type["spec"]["backoffLimit"] = "two"
    assert any(e.startswith("spec.backoffLimit") for e in _errors(loose, bad_type))
    nested = copy.deepcopy(doc)
    nested["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["rayStartParams"]["num-cpus"] = 1
    assert _errors(loose, nested)
    missing = copy.deepcopy(doc)
    del missing["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["groupName"]
    assert any("groupName" in e for e in _errors(loose, missing))
    _, cluster_strict = validators["RayCluster"]
    bad_cluster = copy.deepcopy(_doc("raycluster-gpu.yaml"))
    bad_cluster["spec"]["autoscalerOptions"]["version"] = "v3"
    assert _errors(cluster_strict, bad_cluster)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"},
           "spec": {"containers": [{"name": "a", "image": "b", "securityContxt": {}}]}}
    assert _k8s_errors(kubernetes_validate, pod)
