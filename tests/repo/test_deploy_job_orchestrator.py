"""The job-orchestrator on Kubernetes keeps its pipelines' steps' folders where every replica and every
step's pod reaches them: one ReadWriteMany claim mounted at PIPELINE_DIR in both replicas (whichever
leads resumes a run over the folders the other wrote) and, through K8S_PIPELINE_CLAIM, in every pod."""

from pathlib import Path, PurePosixPath

import yaml

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "OPML_JOB_ORCHESTRATOR_"


def _manifest() -> list[dict]:
    return [d for d in yaml.safe_load_all((ROOT / "deploy" / "k8s" / "job-orchestrator.yaml").read_text()) if d]


def test_the_pipeline_dir_is_one_shared_claim_mounted_by_every_replica_and_step_pod() -> None:
    documents = _manifest()
    (workload,) = [d for d in documents if d["kind"] == "StatefulSet"]
    assert workload["spec"]["replicas"] >= 2
    pod = workload["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    pipeline_dir, home = env.get(f"{PREFIX}PIPELINE_DIR"), env[f"{PREFIX}HOME"]
    assert pipeline_dir, "PIPELINE_DIR unset: the steps' folders would be in the container's /tmp"
    assert not PurePosixPath(pipeline_dir).is_relative_to(home), "jobs cannot enter the service's HOME"
    mounts = [m for m in container["volumeMounts"] if m["mountPath"] == pipeline_dir]
    assert len(mounts) == 1 and not mounts[0].get("readOnly") and not mounts[0].get("subPath")
    templates = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
    assert mounts[0]["name"] not in templates, "a claim template is each replica's own: a failover would lose runs"
    (volume,) = [v for v in pod["volumes"] if v["name"] == mounts[0]["name"]]
    claim = volume["persistentVolumeClaim"]["claimName"]
    assert env.get(f"{PREFIX}K8S_PIPELINE_CLAIM") == claim, "the steps' pods must mount the same claim"
    (pvc,) = [d for d in documents if d["kind"] == "PersistentVolumeClaim" and d["metadata"]["name"] == claim]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
