"""GRPO on Kubernetes (resources/k8s_launcher.py), checked offline: there is no cluster here.

What the launcher renders validates strictly against the Kubernetes API schemas tests/test_deploy.py uses;
the torchrun commands it renders form one job through a real c10d rendezvous, with the Pipes pod as
node 0; ``train`` runs dagster-k8s's own PipesK8sClient against a fake Kubernetes API (the one stand-in,
where a cluster would answer), which shows the pod it submits, the Job and Service created and deleted
around it, the Pipes context every node reads, and the calls the RBAC Role must allow.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import kubernetes
import kubernetes_validate
import pytest
import yaml
from dagster import Failure, MaterializeResult, asset, materialize
from dagster_pipes import PipesContext, PipesDefaultContextLoader, PipesDefaultMessageWriter, PipesMappingParamsLoader
from pydantic import ValidationError

from resources.k8s_launcher import (
    ATTEMPT_FILE,
    CONTEXT_FILE,
    EXAMPLE_FILES,
    RUN_LABEL,
    K8sTrainingLauncher,
    TrainingManifests,
    example_manifests,
    main,
    pipes_bootstrap_env,
    submitted_pod,
)
from resources.launcher import TrainingJob
from rlvr.grpo import GRPOConfig
from rlvr.tasks.gsm8k import REWARDS as GSM8K_REWARDS
from support.k8s_manifests import K8S, K8S_VERSIONS, load_yaml_docs, resource_of_kind
from support.ports import free_port

TRAINING_EXAMPLES = K8S / "training"


def rendered(launcher: K8sTrainingLauncher, nproc: int, scratch: Path = Path("/data/rlvr/models/.work/grpo-runs/r")) -> tuple[TrainingManifests, list[dict]]:
    """The launcher's plan for run ``grpo-r-0`` and every object it submits (the Pipes pod as PipesK8sClient builds it)."""
    plan = launcher.manifests("grpo-r-0", nproc, "rlvr-ops:0.1.0", "rlvr", scratch)
    pod = submitted_pod("dagster-r-grpo-training-0123456789", pipes_bootstrap_env(scratch / CONTEXT_FILE), plan)
    return plan, [pod, *[obj for obj in (plan.service, plan.workers) if obj is not None]]


def container(pod_spec: dict) -> dict:
    (only,) = pod_spec["containers"]
    return only


def flags(command: list[str]) -> dict[str, str]:
    return dict(arg[2:].split("=", 1) for arg in command if arg.startswith("--") and "=" in arg)


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("nodes, gpus_per_node", [(1, 1), (2, 8), (4, 0)])
def test_everything_submitted_validates_strictly(version, nodes, gpus_per_node):
    launcher = K8sTrainingLauncher(nodes=nodes, gpus_per_node=gpus_per_node, node_selector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"})
    _, objects = rendered(launcher, launcher.processes("auto"))
    assert [o["kind"] for o in objects] == (["Pod"] if nodes == 1 else ["Pod", "Service", "Job"])
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)  # raises on any field the API does not know


def test_strict_validation_rejects_a_misspelt_field():
    _, (_, _, job) = rendered(K8sTrainingLauncher(nodes=2), 2)
    job["spec"]["template"]["spec"]["tolerationz"] = job["spec"]["template"]["spec"].pop("tolerations")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSIONS[0], strict=True)


def test_one_node_is_one_standalone_pod_with_its_gpus_and_the_shared_volume():
    plan, (pod,) = rendered(K8sTrainingLauncher(gpus_per_node=4), 4)
    torchrun = container(pod["spec"])
    assert torchrun["command"] == ["torchrun", "--standalone", "--nnodes=1", "--nproc-per-node=4", "-m", "resources.grpo_worker"]
    assert torchrun["resources"]["limits"]["nvidia.com/gpu"] == torchrun["resources"]["requests"]["nvidia.com/gpu"] == "4"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"]["tolerations"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in torchrun["volumeMounts"]}
    assert volumes[mounts["/data/rlvr"]]["persistentVolumeClaim"] == {"claimName": "rlvr-home"}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert pod["spec"]["restartPolicy"] == "Never" and plan.service is None and plan.workers is None
    cpu_only = container(K8sTrainingLauncher(gpus_per_node=0).pod_spec("img", ["torchrun"]))
    assert "nvidia.com/gpu" not in cpu_only["resources"]["limits"]


def test_several_nodes_rendezvous_at_the_pipes_pod():
    plan, (pod, service, job) = rendered(K8sTrainingLauncher(nodes=3, gpus_per_node=8, rendezvous_port=29411), 24)
    pipes, worker = container(pod["spec"]), container(job["spec"]["template"]["spec"])
    pipes_flags, worker_flags = flags(pipes["command"]), flags(worker["command"])
    for f in (pipes_flags, worker_flags):
        assert f["nnodes"] == "3" and f["nproc-per-node"] == "8" and f["rdzv-backend"] == "c10d"
        assert f["rdzv-endpoint"] == f"{service['metadata']['name']}:29411" and f["rdzv-id"] == "grpo-r-0"
    assert pipes_flags["rdzv-conf"].startswith("is_host=1,") and worker_flags["rdzv-conf"].startswith("is_host=0,")
    assert pipes["command"][-2:] == worker["command"][-2:] == ["-m", "resources.grpo_worker"]
    # c10d numbers nodes by sorted local address: the Pipes pod's (the Service name, which resolves to it) first
    assert pipes_flags["local-addr"] == service["metadata"]["name"]
    assert worker_flags["local-addr"] == f"{job['metadata']['name']}-$(JOB_COMPLETION_INDEX)" and worker_flags["local-addr"] > pipes_flags["local-addr"]
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == job["spec"]["parallelism"] == 2
    assert job["spec"]["backoffLimit"] == 0 and job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    # the headless Service selects the Pipes pod (labels as PipesK8sClient merges them), never a worker
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert not service["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["port"] == pipes["ports"][0]["containerPort"] == 29411
    for c in (pipes, worker):
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "8" and c["image"] == "rlvr-ops:0.1.0"
    assert pod["spec"]["volumes"] == job["spec"]["template"]["spec"]["volumes"] and pipes["volumeMounts"] == worker["volumeMounts"]
    assert {o["metadata"]["labels"][RUN_LABEL] for o in (pod, service, job)} == {"grpo-r-0"}


def test_bad_config_names_the_field():
    with pytest.raises(ValidationError, match=r"nodes\n.*greater than or equal to 1"):
        K8sTrainingLauncher(nodes=0)
    with pytest.raises(ValidationError, match=r"gpus_per_node\n.*greater than or equal to 0"):
        K8sTrainingLauncher(gpus_per_node=-1)
    with pytest.raises(ValidationError, match=r"nodes\n"):
        K8sTrainingLauncher.from_env({"RLVR_TRAINING_NODES": "two"})
    launcher = K8sTrainingLauncher(nodes=2, gpus_per_node=4)
    assert launcher.processes("auto") == launcher.processes("8") == 8
    for nproc in ("3", "4", "16"):
        with pytest.raises(ValueError, match=rf"nproc {nproc} does not fit the K8s launcher's nodes \(2\) x gpus_per_node \(4\): use 'auto' or 8 "):
            launcher.processes(nproc)
    with pytest.raises(ValueError, match="nproc must be 'auto' or a positive integer"):
        launcher.processes("many")
    cpu_pods = K8sTrainingLauncher(nodes=2, gpus_per_node=0)
    assert cpu_pods.processes("auto") == 2 and cpu_pods.processes(6) == 6
    with pytest.raises(ValueError, match="use 'auto' or a multiple of 2"):
        cpu_pods.processes(3)
    with pytest.raises(Failure, match="not on the shared volume the pods mount at mount_path '/data/rlvr'"):
        launcher.train(None, training_job(Path("/tmp/elsewhere")), 8)


def test_without_an_image_of_its_own_the_run_must_name_one(tmp_path):
    outcome = launch(K8sTrainingLauncher(namespace="rlvr", mount_path=str(tmp_path)), training_job(tmp_path), 1)
    assert "set image (RLVR_TRAINING_IMAGE)" in outcome["failure"].description


# ---------------------------------------------------------------------------------------------
# What deploy/k8s holds for it
# ---------------------------------------------------------------------------------------------


def test_the_deployed_config_builds_a_launcher_on_the_shared_volume():
    config_map, claim = resource_of_kind("ConfigMap"), resource_of_kind("PersistentVolumeClaim")
    settings = config_map["data"]
    unknown = {k for k in settings if k.startswith("RLVR_TRAINING_")} - {"RLVR_TRAINING_" + f.upper() for f in K8sTrainingLauncher.model_fields}
    assert not unknown, f"not a K8sTrainingLauncher field: {unknown}"
    launcher = K8sTrainingLauncher.from_env(settings)
    assert settings["RLVR_LAUNCHER"] == "k8s" and launcher.gpus_per_node >= 1
    assert launcher.volume_claim == claim["metadata"]["name"] and "ReadWriteMany" in claim["spec"]["accessModes"]
    assert launcher.mount_path == settings["RLVR_HOME"] and launcher.env_config_map == config_map["metadata"]["name"]
    helm = yaml.safe_load((K8S / "dagster-values.yaml").read_text())["dagster-user-deployments"]
    assert helm["deployments"][0]["volumeMounts"][0]["mountPath"] == launcher.mount_path  # the run pod sees the same paths


def test_the_code_locations_service_account_may_launch_training():
    role, binding = resource_of_kind("Role"), resource_of_kind("RoleBinding")
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    helm = yaml.safe_load((K8S / "dagster-values.yaml").read_text())["dagster-user-deployments"]
    (subject,) = binding["subjects"]
    assert subject == {"kind": "ServiceAccount", "name": helm["serviceAccount"]["name"], "namespace": kustomization["namespace"]}
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"]}


def granted(role: dict) -> set[tuple[str, str]]:
    return {(resource, verb) for rule in role["rules"] for resource in rule["resources"] for verb in rule["verbs"]}


def test_the_examples_are_what_the_launcher_renders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["k8s_launcher", "--render", "deploy/k8s/training"])
    main()
    assert sorted(p.name for p in TRAINING_EXAMPLES.glob("*.yaml")) == sorted(EXAMPLE_FILES)
    for name, manifest in example_manifests().items():
        (committed,) = load_yaml_docs(TRAINING_EXAMPLES / name)
        assert committed == manifest, f"{name}: run `python -m resources.k8s_launcher --render deploy/k8s/training`"
        assert (tmp_path / "deploy/k8s/training" / name).read_text() == (TRAINING_EXAMPLES / name).read_text()
        kubernetes_validate.validate(committed, K8S_VERSIONS[-1], strict=True)


# ---------------------------------------------------------------------------------------------
# train(): dagster-k8s against a fake Kubernetes API
# ---------------------------------------------------------------------------------------------


class FakeKubernetes:
    """CoreV1Api and BatchV1Api where a cluster would be. Records each call as (resource, verb); creating
    the Pipes pod "runs" the job: the worker Job's pods (their ranks read the Pipes context from their own
    environment, as grpo_worker's ranks > 0 do), then the Pipes pod, whose rank 0 speaks Pipes on stderr."""

    def __init__(self, per_node: int, fail_rank: int | None = None):
        self.per_node, self.fail_rank = per_node, fail_rank
        self.calls: list[tuple[str, str]] = []
        self.objects: dict[tuple[str, str], dict] = {}
        self.extras_by_rank: dict[int, dict] = {}
        self.pod: dict | None = None
        self.exit_code, self.log = 0, b""
        self.leftover_pods: dict[str, dict] = {}  # pods of an earlier attempt still running: name -> labels

    def create_namespaced_service(self, namespace, body):
        self.calls.append(("services", "create"))
        self.objects["Service", body["metadata"]["name"]] = body

    def delete_namespaced_service(self, name, namespace):
        self.calls.append(("services", "delete"))
        del self.objects["Service", name]

    def create_namespaced_job(self, namespace, body):
        self.calls.append(("jobs", "create"))
        self.objects["Job", body["metadata"]["name"]] = body

    def delete_namespaced_job(self, name, namespace, propagation_policy=None):
        self.calls.append(("jobs", "delete"))
        assert propagation_policy in ("Background", "Foreground"), "the Job's pods must go with it"
        del self.objects["Job", name]

    def create_namespaced_pod(self, namespace, body):
        self.calls.append(("pods", "create"))
        self.pod = {"apiVersion": "v1", "kind": "Pod", **kubernetes.client.ApiClient().sanitize_for_serialization(body)}
        assert self.pod["metadata"]["namespace"] == namespace
        (job,) = [o for (kind, _), o in self.objects.items() if kind == "Job"] or [None]
        nodes = [env_of(job["spec"]["template"]["spec"])] * job["spec"]["completions"] if job else []
        scratch = Path(self.read_context(env_of(self.pod["spec"]))["scratch"])
        for rank in range(self.per_node, self.per_node * (1 + len(nodes))):  # worker nodes: global ranks per_node...
            self.extras_by_rank[rank] = self.read_context(nodes[rank // self.per_node - 1])
        for rank in range(1, self.per_node):  # the Pipes pod's other local ranks
            self.extras_by_rank[rank] = self.read_context(env_of(self.pod["spec"]))
        if self.fail_rank is not None:
            (scratch / "errors").mkdir(parents=True, exist_ok=True)
            (scratch / "errors" / f"rank-{self.fail_rank}.txt").write_text("RuntimeError: NCCL error: unhandled system error")
            self.exit_code = 1
            return
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            # what open_dagster_pipes builds in a fresh process (this one may hold an earlier test's context)
            with PipesContext(PipesMappingParamsLoader(env_of(self.pod["spec"])), PipesDefaultContextLoader(), PipesDefaultMessageWriter()) as pipes:
                self.extras_by_rank[0] = dict(pipes.extras)
                pipes.log.info("step 1/1: reward 0.250")
        (scratch / "steps").mkdir(parents=True, exist_ok=True)  # rank 0 keeps each step's metrics, as grpo_worker does
        (scratch / "steps" / "metrics-step000001.json").write_text(json.dumps({"reward_mean": 0.25, "loss": 0.5}))
        (scratch / "digests").mkdir(parents=True, exist_ok=True)
        for rank in self.extras_by_rank:
            (scratch / "digests" / f"rank-{rank}.txt").write_text("same weights")
        stamps = (f"2026-01-01T00:00:{i:02d}.000000Z" for i in range(60))
        self.log = "".join(f"{stamp} {line}\n" for stamp, line in zip(stamps, stderr.getvalue().splitlines())).encode()

    @staticmethod
    def read_context(env: dict) -> dict:
        with PipesDefaultContextLoader().load_context(PipesMappingParamsLoader(env).load_context_params()) as data:
            return dict(data["extras"])

    def list_namespaced_pod(self, namespace, field_selector=None, label_selector=None):
        self.calls.append(("pods", "list"))
        if label_selector is not None:  # the pods an attempt left behind, by their run label
            key, value = label_selector.split("=")
            return SimpleNamespace(items=[SimpleNamespace(metadata=SimpleNamespace(name=n)) for n, pod in self.leftover_pods.items() if pod[key] == value])
        name = self.pod["metadata"]["name"]
        assert field_selector == f"metadata.name={name}"
        terminated = SimpleNamespace(exit_code=self.exit_code, message=None, reason="Error" if self.exit_code else "Completed")
        status = SimpleNamespace(name="torchrun", ready=False, state=SimpleNamespace(running=None, waiting=None, terminated=terminated))
        pod = SimpleNamespace(metadata=SimpleNamespace(name=name), status=SimpleNamespace(init_container_statuses=[], container_statuses=[status]))
        return SimpleNamespace(items=[pod])

    def read_namespaced_pod_log(self, name, namespace, **kwargs):
        self.calls.append(("pods/log", "get"))
        return SimpleNamespace(data=self.log) if "tail_lines" in kwargs else iter([self.log])  # a failure's tail, else the followed stream

    def delete_namespaced_pod(self, name, namespace):
        self.calls.append(("pods", "delete"))
        self.leftover_pods.pop(name, None)


def env_of(pod_spec: dict) -> dict:
    return {e["name"]: e["value"] for e in container(pod_spec).get("env", [])}


@pytest.fixture
def fake_cluster(monkeypatch):
    """Installs a FakeKubernetes for both APIs (the launcher's and PipesK8sClient's); no kubeconfig is read."""

    def install(fake: FakeKubernetes) -> FakeKubernetes:
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        monkeypatch.setattr(kubernetes.config, "load_kube_config", lambda *a, **k: None)
        monkeypatch.setattr(kubernetes.client, "CoreV1Api", lambda *a, **k: fake)
        monkeypatch.setattr(kubernetes.client, "BatchV1Api", lambda *a, **k: fake)
        return fake

    return install


def training_job(home: Path) -> TrainingJob:
    scratch = home / "models" / ".work" / "grpo-runs" / "r"
    rows = [{"id": "p1", "question": "1 + 1?", "answer": "2"}]
    return TrainingJob("r", home / "models" / "base_policy" / "v1", rows, GRPOConfig(), dict(GSM8K_REWARDS), scratch, device="cpu")


def launch(launcher: K8sTrainingLauncher, job: TrainingJob, nproc: int, on_step=None) -> dict:
    """``launcher.train`` inside a real materialization (a real Dagster context and Pipes session)."""
    outcome: dict = {}

    @asset(name="grpo_training")
    def grpo_training(context):
        outcome["name"] = f"grpo-{context.run.run_id[:8]}-0"
        try:
            outcome["history"] = launcher.train(context, job, nproc, on_step=on_step)
        except Failure as failure:
            outcome["failure"] = failure
        return MaterializeResult()  # a step that opened a Pipes session reports its asset

    assert materialize([grpo_training]).success
    return outcome


def test_train_runs_the_pipes_pod_between_creating_and_deleting_the_rendezvous(tmp_path, fake_cluster):
    fake = fake_cluster(FakeKubernetes(per_node=2))
    launcher = K8sTrainingLauncher(nodes=3, gpus_per_node=2, image="rlvr-ops:0.1.0", namespace="rlvr", mount_path=str(tmp_path))
    job, streamed = training_job(tmp_path), []
    outcome = launch(launcher, job, 6, on_step=lambda step, metrics: streamed.append((step, metrics)))
    assert outcome["history"] == streamed == [(1, {"reward_mean": 0.25, "loss": 0.5})]
    creates = [c for c in fake.calls if c[1] == "create"]
    assert creates == [("services", "create"), ("jobs", "create"), ("pods", "create")]
    assert fake.calls[-3:] == [("pods", "delete"), ("jobs", "delete"), ("services", "delete")] and not fake.objects
    # the pod PipesK8sClient submitted is the one the launcher renders (same Pipes environment included)
    plan = launcher.manifests(outcome["name"], 6, "rlvr-ops:0.1.0", "rlvr", job.scratch)
    assert fake.pod == submitted_pod(fake.pod["metadata"]["name"], pipes_bootstrap_env(job.scratch / CONTEXT_FILE), plan)
    kubernetes_validate.validate(fake.pod, K8S_VERSIONS[-1], strict=True)
    # all six ranks on three nodes read the one Pipes context; several processes: torchrun picks each device
    assert sorted(fake.extras_by_rank) == list(range(6)) and all(e == fake.extras_by_rank[0] for e in fake.extras_by_rank.values())
    assert fake.extras_by_rank[0]["scratch"] == str(job.scratch) and fake.extras_by_rank[0]["device"] is None
    assert not (job.scratch / CONTEXT_FILE).exists()  # the session removed it
    assert set(fake.calls) <= granted(resource_of_kind("Role")), "deploy/k8s/training-launcher-role.yaml must allow every call"


def test_a_failed_run_reports_the_ranks_and_still_deletes_the_rendezvous(tmp_path, fake_cluster):
    fake = fake_cluster(FakeKubernetes(per_node=2, fail_rank=3))
    launcher = K8sTrainingLauncher(nodes=2, gpus_per_node=2, image="rlvr-ops:0.1.0", namespace="rlvr", mount_path=str(tmp_path))
    outcome = launch(launcher, training_job(tmp_path), 4)
    description = outcome["failure"].description
    assert description.startswith("GRPO training failed (") and "--- rank 3 ---\nRuntimeError: NCCL error" in description
    assert "rank(s) [0, 1, 2] died without leaving an error" in description
    assert ("jobs", "delete") in fake.calls and ("services", "delete") in fake.calls and not fake.objects


def test_one_gpu_pod_trains_on_its_gpu_without_a_rendezvous(tmp_path, fake_cluster):
    fake = fake_cluster(FakeKubernetes(per_node=1))
    launcher = K8sTrainingLauncher(gpus_per_node=1, image="rlvr-ops:0.1.0", namespace="rlvr", mount_path=str(tmp_path))
    outcome = launch(launcher, training_job(tmp_path), 1)
    assert outcome["history"] == [(1, {"reward_mean": 0.25, "loss": 0.5})]
    assert {resource for resource, _ in fake.calls} == {"pods", "pods/log"}  # no Service, no Job
    assert fake.extras_by_rank[0]["device"] == "cuda"  # the pod's GPU, not the run pod's device ("cpu" in the job)


# ---------------------------------------------------------------------------------------------
# The rendered commands under a real torchrun
# ---------------------------------------------------------------------------------------------

PROBE = """
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.tensor([float(os.environ["RANK"])])
dist.all_reduce(total)
with open(os.path.join(sys.argv[1], f"rank-{os.environ['RANK']}.txt"), "w") as f:
    f.write(f"{os.environ['NODE']} {os.environ['GROUP_RANK']} {total.item()}")
dist.destroy_process_group()
"""


@pytest.mark.slow  # launches torchrun
def test_the_rendered_commands_rendezvous_with_the_pipes_pod_as_node_zero(tmp_path):
    """Two nodes of two CPU processes, started in the cluster's order (the worker Job first). No cluster DNS
    here: the Service name stands for 127.0.0.1, what it resolves to from every pod, and $(JOB_COMPLETION_INDEX)
    is expanded as the kubelet would."""
    launcher = K8sTrainingLauncher(nodes=2, gpus_per_node=0, rendezvous_port=free_port(), rendezvous_timeout_s=90)
    plan = launcher.manifests("grpo-r-0", 4, "img", "rlvr", tmp_path)
    (tmp_path / "probe.py").write_text(PROBE)

    def local(spec: dict) -> list[str]:
        command = [arg.replace("$(JOB_COMPLETION_INDEX)", "0").replace("grpo-r-0", "127.0.0.1") for arg in container(spec)["command"]]
        assert command[0] == "torchrun" and command[-2:] == ["-m", "resources.grpo_worker"]
        return [sys.executable, "-m", "torch.distributed.run", *command[1:-2], str(tmp_path / "probe.py"), str(tmp_path)]

    worker = subprocess.Popen(local(plan.workers["spec"]["template"]["spec"]), env={**os.environ, "NODE": "worker"}, stderr=subprocess.PIPE, text=True)
    time.sleep(1)  # the worker Job's pods start first, as in the cluster (the rendezvous takes either order)
    pipes = subprocess.Popen(local(plan.pod_spec), env={**os.environ, "NODE": "pipes"}, stderr=subprocess.PIPE, text=True)
    for proc in (pipes, worker):
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-3000:]
    ranks = {int(p.stem.split("-")[1]): p.read_text().split() for p in tmp_path.glob("rank-*.txt")}
    assert ranks == {0: ["pipes", "0", "6.0"], 1: ["pipes", "0", "6.0"], 2: ["worker", "1", "6.0"], 3: ["worker", "1", "6.0"]}


def test_the_deployment_selects_the_launcher_by_environment(tmp_path, monkeypatch):
    from rlvr.settings import Settings
    from rlvr_assets.resources import default_resources

    monkeypatch.delenv("RLVR_LAUNCHER", raising=False)
    assert type(default_resources(Settings(tmp_path))["launcher"]).__name__ == "TrainingLauncher"
    monkeypatch.setenv("RLVR_LAUNCHER", "k8s")
    monkeypatch.setenv("RLVR_TRAINING_NODES", "2")
    monkeypatch.setenv("RLVR_TRAINING_NODE_SELECTOR", '{"pool": "h100"}')
    launcher = default_resources(Settings(tmp_path))["launcher"]
    assert isinstance(launcher, K8sTrainingLauncher) and launcher.nodes == 2 and launcher.node_selector == {"pool": "h100"}


def test_an_attempt_first_deletes_what_a_killed_earlier_attempt_left_running(tmp_path, fake_cluster):
    """The run pod of an earlier attempt was killed: its training pods, worker Job and rendezvous Service
    went on. The re-execution deletes them (named in the scratch folder) before it trains."""
    fake = fake_cluster(FakeKubernetes(per_node=2))
    launcher = K8sTrainingLauncher(nodes=2, gpus_per_node=2, image="rlvr-ops:0.1.0", namespace="rlvr", mount_path=str(tmp_path))
    job = training_job(tmp_path)
    earlier = launcher.manifests("grpo-0ld-0", 4, "rlvr-ops:0.1.0", "rlvr", job.scratch)
    for obj in (earlier.service, earlier.workers):
        fake.objects[obj["kind"], obj["metadata"]["name"]] = obj
    fake.leftover_pods = {"dagster-0ld-grpo-training": {RUN_LABEL: "grpo-0ld-0"}, "someone-else": {RUN_LABEL: "grpo-other-0"}}
    job.scratch.mkdir(parents=True)
    (job.scratch / ATTEMPT_FILE).write_text(json.dumps({"name": "grpo-0ld-0", "namespace": "rlvr", "objects": [earlier.workers, earlier.service]}))
    (job.scratch / "export.tmp").mkdir()  # the killed attempt's half-written export
    outcome = launch(launcher, job, 4)
    assert outcome["history"] == [(1, {"reward_mean": 0.25, "loss": 0.5})]
    assert set(fake.calls[:2]) == {("jobs", "delete"), ("services", "delete")}  # before anything is created
    assert fake.calls[2:4] == [("pods", "list"), ("pods", "delete")]
    assert list(fake.leftover_pods) == ["someone-else"] and not fake.objects
    assert not (job.scratch / ATTEMPT_FILE).exists() and not (job.scratch / "export.tmp").exists()
    assert set(fake.calls) <= granted(resource_of_kind("Role")), "deploy/k8s/training-launcher-role.yaml must allow every call"
