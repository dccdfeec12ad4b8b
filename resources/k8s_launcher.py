"""Launching GRPO training on Kubernetes: torchrun in GPU pods of its own, through Dagster Pipes (dagster-k8s).

:class:`K8sTrainingLauncher` is :class:`~resources.launcher.TrainingLauncher` on a cluster: the same
worker (:mod:`resources.grpo_worker`), Pipes extras and scratch folder, on the shared ``rlvr-home``
claim (ReadWriteMany) that the run pod and every training pod mount at one path. One node is one pod
that :class:`dagster_k8s.PipesK8sClient` creates and follows; N nodes add an indexed Job of N-1
worker pods, joined by torchrun's c10d rendezvous hosted by the Pipes pod (node 0, global rank 0)
behind a headless Service. Every pod reads the same Pipes context, a file in the scratch folder
(:class:`dagster.PipesFileContextInjector`).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Optional

import yaml
from dagster import ConfigurableResource, Failure, PipesFileContextInjector
from dagster_pipes import (
    DAGSTER_PIPES_CONTEXT_ENV_VAR,
    DAGSTER_PIPES_MESSAGES_ENV_VAR,
    PipesDefaultContextLoader,
    PipesDefaultMessageWriter,
    encode_env_var,
)
from pydantic import Field

from resources.launcher import (
    WORKER_MODULE,
    OnStep,
    StepMetrics,
    TrainingJob,
    TrainingLauncher,
    attempt_lock,
    check_digests,
    clear_attempt,
    process_count,
    step_history,
    training_failure,
)
from rlvr.files import write_atomically

GPU = "nvidia.com/gpu"
RUN_LABEL = "rlvr-ops/training-run"  # every object of one run: kubectl delete pod,job,service -l rlvr-ops/training-run=<name>
ROLE_LABEL = "rlvr-ops/node-role"  # pipes (node 0) or worker
CONTEXT_FILE = "pipes-context.json"  # in the run's scratch folder
ATTEMPT_FILE = "k8s-attempt.json"  # in the run's scratch folder: the objects of the attempt training there, for the next one to stop
ENV_PREFIX = "RLVR_TRAINING_"  # K8sTrainingLauncher.from_env: RLVR_TRAINING_<FIELD>


@dataclass
class TrainingManifests:
    """What one run submits: the Pipes pod's metadata and spec (PipesK8sClient adds its name and the Pipes
    environment), and for several nodes the rendezvous Service and the worker Job, created before it."""

    pod_meta: dict
    pod_spec: dict
    service: dict | None = None
    workers: dict | None = None


class K8sTrainingLauncher(ConfigurableResource):
    """Runs the GRPO worker under torchrun in Kubernetes pods through Dagster Pipes (``nodes`` x ``gpus_per_node``)."""

    image: Optional[str] = Field(default=None, description="the training pods' image; None: the image the run itself runs in (its code location's)")
    namespace: Optional[str] = Field(default=None, description="where the training pods go; None: the run pod's namespace")
    nodes: int = Field(default=1, ge=1, description="pods per run: 1 is one pod; more add an indexed Job of nodes-1 pods, joined by torchrun's c10d rendezvous")
    gpus_per_node: int = Field(default=1, ge=0, description="nvidia.com/gpu of each pod, one torchrun process per GPU; 0: CPU pods")
    cpu: str = Field(default="8", description="CPU request of each pod")
    memory: str = Field(default="64Gi", description="memory request and limit of each pod (the in-memory /dev/shm counts against it)")
    shm_size: str = Field(default="16Gi", description="size of each pod's in-memory /dev/shm (NCCL, DataLoader workers)")
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="nodeSelector of the training pods, e.g. {'nvidia.com/gpu.product': 'NVIDIA-H100-80GB-HBM3'}"
    )
    volume_claim: str = Field(default="rlvr-home", description="the ReadWriteMany claim of $RLVR_HOME (deploy/k8s/rlvr-home-pvc.yaml)")
    mount_path: str = Field(default="/data/rlvr", description="where every pod mounts it: the run pod's $RLVR_HOME (deploy/k8s/rlvr-config.yaml)")
    env_config_map: Optional[str] = Field(default="rlvr-config", description="ConfigMap the pods take their environment from")
    service_account_name: Optional[str] = Field(default=None, description="the training pods' service account (they never call the Kubernetes API)")
    run_as_user: int = Field(default=1034, description="uid and gid of the training pods: the image's user, owner of the shared volume")
    rendezvous_port: int = Field(default=29400, description="port of the c10d rendezvous store on the Pipes pod")
    rendezvous_timeout_s: int = Field(default=1800, description="how long nodes wait for one another (GPU scheduling, image pulls)")
    image_pull_policy: str = Field(default="IfNotPresent", description="imagePullPolicy of the training pods")
    timeout_s: float = Field(default=0, ge=0, description="how long the Pipes pod may run before the run fails; 0: no limit (dagster-k8s's default is a day)")

    step_rows = staticmethod(TrainingLauncher.step_rows)
    exported = staticmethod(TrainingLauncher.exported)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> K8sTrainingLauncher:
        """The launcher set by ``RLVR_TRAINING_<FIELD>`` variables (deploy/k8s/rlvr-config.yaml); node_selector as JSON."""
        values: dict[str, Any] = {name: env[ENV_PREFIX + name.upper()] for name in cls.model_fields if ENV_PREFIX + name.upper() in env}
        if "node_selector" in values:
            values["node_selector"] = json.loads(values["node_selector"])
        return cls(**values)

    def processes(self, nproc: str | int) -> int:
        """Processes of a run: ``"auto"`` is nodes x gpus_per_node (one per CPU pod); an integer must be that."""
        count = self.nodes * max(self.gpus_per_node, 1) if nproc == "auto" else process_count(nproc, 0)
        self.per_node(count)
        return count

    def per_node(self, nproc: int) -> int:
        """torchrun processes of each pod; ValueError naming the fields ``nproc`` does not fit."""
        per_node, extra = divmod(nproc, self.nodes)
        if extra or not per_node or (self.gpus_per_node and per_node != self.gpus_per_node):
            fits = f"{self.nodes * self.gpus_per_node} (one process per GPU)" if self.gpus_per_node else f"a multiple of {self.nodes}"
            raise ValueError(f"nproc {nproc} does not fit the K8s launcher's nodes ({self.nodes}) x gpus_per_node ({self.gpus_per_node}): use 'auto' or {fits}")
        return per_node

    def manifests(self, name: str, nproc: int, image: str, namespace: str, scratch: Path) -> TrainingManifests:
        """Everything a run of ``nproc`` processes named ``name`` submits (``scratch``: its folder on the shared volume)."""
        per_node, labels = self.per_node(nproc), {"app.kubernetes.io/component": "grpo-training", "app.kubernetes.io/part-of": "rlvr-ops", RUN_LABEL: name}
        pod_meta = {"namespace": namespace, "labels": {**labels, ROLE_LABEL: "pipes"}}
        if self.nodes == 1:
            command = ["torchrun", "--standalone", "--nnodes=1", f"--nproc-per-node={per_node}", "-m", WORKER_MODULE]
            return TrainingManifests(pod_meta, self.pod_spec(image, command))
        service = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "spec": {
                "clusterIP": "None",  # headless: the name resolves to the Pipes pod's own address
                "publishNotReadyAddresses": True,  # from the moment it has one, not once it is Ready
                "selector": {RUN_LABEL: name, ROLE_LABEL: "pipes"},
                "ports": [{"name": "rendezvous", "port": self.rendezvous_port, "targetPort": self.rendezvous_port, "protocol": "TCP"}],
            },
        }
        ports = [{"name": "rendezvous", "containerPort": self.rendezvous_port, "protocol": "TCP"}]
        pod_spec = self.pod_spec(image, self.rendezvous_command(name, per_node, host=True, local_addr=name), ports=ports)
        worker_env = {  # what PipesK8sClient gives a pod's other containers: the same context, messages to nowhere
            DAGSTER_PIPES_CONTEXT_ENV_VAR: pipes_bootstrap_env(scratch / CONTEXT_FILE)[DAGSTER_PIPES_CONTEXT_ENV_VAR],
            DAGSTER_PIPES_MESSAGES_ENV_VAR: encode_env_var({PipesDefaultMessageWriter.FILE_PATH_KEY: "/dev/null"}),
        }
        workers_name = f"{name}-workers"  # its pods' hostnames, and local addresses: <name>-workers-<index>
        worker_command = self.rendezvous_command(name, per_node, host=False, local_addr=f"{workers_name}-$(JOB_COMPLETION_INDEX)")
        workers = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": workers_name, "namespace": namespace, "labels": labels},
            "spec": {
                "completionMode": "Indexed",
                "completions": self.nodes - 1,
                "parallelism": self.nodes - 1,
                "backoffLimit": 0,  # torchrun cannot take a node back mid-run: the run fails, its re-execution resumes
                "ttlSecondsAfterFinished": 3600,  # the launcher deletes it; this is for a run pod that died first
                "template": {"metadata": {"labels": {**labels, ROLE_LABEL: "worker"}}, "spec": self.pod_spec(image, worker_command, worker_env)},
            },
        }
        return TrainingManifests(pod_meta, pod_spec, service, workers)

    def rendezvous_command(self, name: str, per_node: int, host: bool, local_addr: str) -> list[str]:
        """torchrun of one of several nodes: c10d rendezvous at the Service ``name``, hosted by the Pipes pod."""
        timeouts = f"join_timeout={self.rendezvous_timeout_s},read_timeout={self.rendezvous_timeout_s}"
        return [
            "torchrun",
            f"--nnodes={self.nodes}",
            f"--nproc-per-node={per_node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={name}:{self.rendezvous_port}",
            f"--rdzv-id={name}",
            f"--rdzv-conf=is_host={int(host)},{timeouts}",
            f"--local-addr={local_addr}",
            "-m",
            WORKER_MODULE,
        ]

    def pod_spec(self, image: str, command: list[str], env: Mapping[str, str] | None = None, ports: list[dict] | None = None) -> dict:
        """One training pod: its GPUs, the shared volume at ``mount_path``, an in-memory /dev/shm."""
        gpus = {GPU: str(self.gpus_per_node)} if self.gpus_per_node else {}
        container: dict[str, Any] = {
            "name": "torchrun",
            "image": image,
            "imagePullPolicy": self.image_pull_policy,
            "command": command,
            **({"env": [{"name": k, "value": v} for k, v in env.items()]} if env else {}),
            **({"envFrom": [{"configMapRef": {"name": self.env_config_map}}]} if self.env_config_map else {}),
            **({"ports": ports} if ports else {}),
            "resources": {"requests": {"cpu": self.cpu, "memory": self.memory, **gpus}, "limits": {"memory": self.memory, **gpus}},
            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
            "volumeMounts": [{"name": "rlvr-home", "mountPath": self.mount_path}, {"name": "dshm", "mountPath": "/dev/shm"}],
        }
        user = self.run_as_user
        spec: dict[str, Any] = {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "securityContext": {"runAsNonRoot": True, "runAsUser": user, "runAsGroup": user, "fsGroup": user, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [container],
            "volumes": [
                {"name": "rlvr-home", "persistentVolumeClaim": {"claimName": self.volume_claim}},
                {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": self.shm_size}},
            ],
        }
        if self.gpus_per_node:
            spec["tolerations"] = [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}]
        if self.node_selector:
            spec["nodeSelector"] = dict(self.node_selector)
        if self.service_account_name:
            spec["serviceAccountName"] = self.service_account_name
        return spec

    def train(self, context: Any, job: TrainingJob, nproc: int, restart: bool = False, on_step: OnStep | None = None) -> list[tuple[int, dict]]:
        """Run ``job`` on ``nproc`` processes in pods; returns (step, metrics) of every step of the run (earlier
        attempts' included), handing each to ``on_step`` as it ends. Holds the scratch folder as the local
        launcher does (:func:`~resources.launcher.attempt_lock`: a second attempt while one lives is refused);
        holding it, first deletes the pods a dead earlier attempt left running there (its run pod killed);
        creates the rendezvous Service and worker Job (several nodes), runs the Pipes pod, deletes them all
        whatever happens. A failed run raises :class:`dagster.Failure` with each rank's account."""
        from dagster_k8s import PipesK8sClient  # the cluster client, only where a run needs it
        from dagster_k8s.client import DagsterK8sError
        from dagster_k8s.utils import detect_current_namespace

        for path in (job.scratch, job.start):
            if not Path(path).is_relative_to(self.mount_path):
                raise Failure(description=f"K8sTrainingLauncher: {path} is not on the shared volume the pods mount at mount_path {self.mount_path!r}")
        image = self.image or run_image(context)
        if not image:
            raise Failure(description="K8sTrainingLauncher: set image (RLVR_TRAINING_IMAGE): this run has no container image of its own")
        name, namespace = f"grpo-{context.run.run_id[:8]}-{context.retry_number}", self.namespace or detect_current_namespace(None) or "default"
        job = replace(job, device=("cuda" if self.gpus_per_node else "cpu") if nproc == 1 else None)  # the pod's device, not the run pod's
        with attempt_lock(job.scratch, context.run.run_id):  # on the shared volume: one attempt at a time, wherever its run pod runs
            stop_earlier_attempt(job.scratch, context)
            clear_attempt(job.scratch, restart)
            plan, extras = self.manifests(name, nproc, image, namespace, job.scratch), job.extras()
            apis, created = kubernetes_apis() if plan.workers is not None else None, []
            record = {"name": name, "namespace": namespace, "objects": [o for o in (plan.workers, plan.service) if o is not None]}
            write_atomically(job.scratch / ATTEMPT_FILE, json.dumps(record))
            metrics, done = StepMetrics(job.scratch, on_step), threading.Event()

            def follow() -> None:  # each step's metrics as it ends, while PipesK8sClient follows the pod
                while not done.wait(1.0):
                    metrics.poll()

            follower = threading.Thread(target=follow, daemon=True)
            try:
                if plan.workers is not None:
                    created = create_objects(apis, namespace, [plan.service, plan.workers])
                follower.start()
                pipes = PipesK8sClient(context_injector=PipesFileContextInjector(str(job.scratch / CONTEXT_FILE)))
                pipes.run(
                    context=context,
                    extras=extras,
                    namespace=namespace,
                    base_pod_meta=plan.pod_meta,
                    base_pod_spec=plan.pod_spec,
                    pod_wait_timeout=self.timeout_s,
                )
            except DagsterK8sError as err:
                raise training_failure(err, job.scratch, nproc) from None
            finally:
                done.set()
                if follower.is_alive():
                    follower.join()
                metrics.poll()
                delete_objects(apis, namespace, created, context)
                (job.scratch / ATTEMPT_FILE).unlink(missing_ok=True)
        check_digests(job.scratch, nproc)
        return step_history(job.scratch)


def stop_earlier_attempt(scratch: Path, context: Any) -> None:
    """Delete what an earlier attempt on ``scratch`` left running (its run pod killed before it could):
    its worker Job (with its pods), rendezvous Service and Pipes pod, named in its ``k8s-attempt.json``.
    Called holding the attempt lock, so that attempt is gone."""
    path = scratch / ATTEMPT_FILE
    if not path.is_file():
        return
    earlier = json.loads(path.read_text())
    apis, namespace = kubernetes_apis(), earlier["namespace"]
    delete_objects(apis, namespace, earlier["objects"], context)
    pods = apis[0].list_namespaced_pod(namespace, label_selector=f"{RUN_LABEL}={earlier['name']}").items
    for pod in pods:
        apis[0].delete_namespaced_pod(pod.metadata.name, namespace)
    context.log.warning(
        f"K8sTrainingLauncher: deleted what attempt {earlier['name']} left on {scratch}: {len(earlier['objects'])} object(s), {len(pods)} pod(s)"
    )
    path.unlink()


def pipes_bootstrap_env(context_file: Path) -> dict[str, str]:
    """The Pipes environment PipesK8sClient gives its pod when the context is the file ``context_file`` and
    messages come back through the pod's log (its default reader): known before the session opens."""
    return {
        DAGSTER_PIPES_CONTEXT_ENV_VAR: encode_env_var({PipesDefaultContextLoader.FILE_PATH_KEY: str(context_file)}),
        DAGSTER_PIPES_MESSAGES_ENV_VAR: encode_env_var({PipesDefaultMessageWriter.STDIO_KEY: PipesDefaultMessageWriter.STDERR}),
    }


def run_image(context: Any) -> str | None:
    """The image the run itself runs in: its code location's, which K8sRunLauncher gave the run pod."""
    origin = context.run.job_code_origin
    return origin.repository_origin.container_image if origin is not None else None


def kubernetes_apis() -> tuple[Any, Any]:
    """(CoreV1Api, BatchV1Api) of the cluster this runs in, else of the kubeconfig's current context."""
    import kubernetes

    if os.getenv("KUBERNETES_SERVICE_HOST"):
        kubernetes.config.load_incluster_config()
    else:
        kubernetes.config.load_kube_config()
    return kubernetes.client.CoreV1Api(), kubernetes.client.BatchV1Api()


def create_objects(apis: tuple[Any, Any], namespace: str, objects: list[dict]) -> list[dict]:
    """Create the Services and Jobs ``objects`` in order; returns those created (all, or raises Failure)."""
    from kubernetes.client.exceptions import ApiException

    (core, batch), created = apis, []
    for obj in objects:
        create = core.create_namespaced_service if obj["kind"] == "Service" else batch.create_namespaced_job
        try:
            create(namespace, obj)
        except ApiException as err:
            delete_objects(apis, namespace, created)
            rbac = " (RBAC: deploy/k8s/training-launcher-role.yaml)" if err.status == 403 else ""
            raise Failure(
                description=f"K8sTrainingLauncher: could not create {obj['kind']} {obj['metadata']['name']}{rbac}: {err.status} {err.reason}"
            ) from None
        created.append(obj)
    return created


def delete_objects(apis: tuple[Any, Any] | None, namespace: str, objects: list[dict], context: Any = None) -> None:
    """Delete ``objects`` (a Job with its pods), newest first; a failure to delete is a warning, not the run's error."""
    from kubernetes.client.exceptions import ApiException

    for obj in reversed(objects):
        (core, batch), name = apis, obj["metadata"]["name"]
        try:
            if obj["kind"] == "Job":
                batch.delete_namespaced_job(name, namespace, propagation_policy="Background")
            else:
                core.delete_namespaced_service(name, namespace)
        except ApiException as err:
            if err.status != 404 and context is not None:
                context.log.warning(f"K8sTrainingLauncher: could not delete {obj['kind']} {name}: {err.status} {err.reason}")


def submitted_pod(pod_name: str, env: Mapping[str, str], plan: TrainingManifests) -> dict:
    """The Pipes pod as PipesK8sClient submits it (its own ``build_pod_body``), as a manifest."""
    import kubernetes
    from dagster_k8s.pipes import build_pod_body

    body = build_pod_body(pod_name=pod_name, image=None, command=None, env_vars=env, base_pod_meta=plan.pod_meta, base_pod_spec=plan.pod_spec)
    return {"apiVersion": "v1", "kind": "Pod", **kubernetes.client.ApiClient().sanitize_for_serialization(body)}


EXAMPLE_RUN_ID = "0123abcd-4567-89ef-0123-456789abcdef"
EXAMPLE_FILES = ("pipes-pod.yaml", "rendezvous-service.yaml", "workers-job.yaml")


def example_manifests(nodes: int = 2, gpus_per_node: int = 8, image: str = "rlvr-ops:0.1.0", namespace: str = "rlvr") -> dict[str, dict]:
    """deploy/k8s/training/: what the launcher submits for the first attempt of run ``EXAMPLE_RUN_ID``, by file name."""
    launcher = K8sTrainingLauncher(nodes=nodes, gpus_per_node=gpus_per_node, image=image, namespace=namespace)
    name, scratch = f"grpo-{EXAMPLE_RUN_ID[:8]}-0", Path(launcher.mount_path) / "models/.work/grpo-runs" / EXAMPLE_RUN_ID
    plan = launcher.manifests(name, launcher.processes("auto"), image, namespace, scratch)
    pod_name = f"dagster-{EXAMPLE_RUN_ID[:18]}-grpo-training-0000000000"  # PipesK8sClient's pattern; its suffix is random
    return dict(zip(EXAMPLE_FILES, (submitted_pod(pod_name, pipes_bootstrap_env(scratch / CONTEXT_FILE), plan), plan.service, plan.workers)))


def main() -> None:
    parser = argparse.ArgumentParser(description="Render what K8sTrainingLauncher submits for one run (nothing is sent to a cluster).")
    parser.add_argument("--render", type=Path, required=True, help="folder to write the manifests to (deploy/k8s/training)")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    args = parser.parse_args()
    args.render.mkdir(parents=True, exist_ok=True)
    for file, manifest in example_manifests(args.nodes, args.gpus_per_node).items():
        if manifest is None:  # one node: the pod alone
            continue
        header = (
            f"# Rendered by `python -m resources.k8s_launcher --render {args.render}` (nodes {args.nodes}, gpus_per_node {args.gpus_per_node}):\n"
            "# what K8sTrainingLauncher submits for one GRPO run. An example, not applied by kustomization.yaml:\n"
            "# the launcher creates these per run and deletes them when the run ends (deploy/README.md).\n"
        )
        (args.render / file).write_text(header + yaml.safe_dump(manifest, sort_keys=False))


if __name__ == "__main__":
    main()
