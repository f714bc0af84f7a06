"""`sglang-dsv4 k8s`: Kubernetes manifests for the PD deployment, with the memory plan's figures.

For each serving role (prefill, decode) the plan runs as `sglang-dsv4 plan` runs it, and the
manifests carry what it found: the image environment of its launch section (TP, the index-K
dtype, --mem-fraction-static and --max-running-requests, through the image's own variables), the
GPU request (TP per engine), and the plan's figures as pod annotations. Nothing is computed here
that the plan computes, so `plan` and the manifests cannot disagree.

Every pod runs the image's entrypoint (docker/entrypoint.sh) with its role as the only argument
(plus, for an engine spanning nodes, the node rank and rendezvous from LeaderWorkerSet's own
variables), so a pod starts the command `entrypoint.sh ROLE --dry-run` prints.

Objects written:
- a Namespace (unless `default`);
- per role, a ConfigMap of the image environment;
- per role, a headless Service (one DNS name per pod: the router addresses each server, and decode
  reaches each prefill's bootstrap port) and a StatefulSet when one engine fits a node, or a
  LeaderWorkerSet (leaderworkerset.x-k8s.io/v1, its controller installed in the cluster) when TP
  spans nodes; the LeaderWorkerSet makes its own headless Service;
- the router: a ConfigMap with every prefill and decode server's address, a Deployment, a Service.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from sglang_dsv4 import __version__

ROLES = ("prefill", "decode")
ENTRYPOINT = "/opt/sglang-dsv4/entrypoint.sh"  # the image's ENTRYPOINT, used as is
IMAGE_UID = 1001  # docker/Dockerfile's numeric user
HTTP_PORT = {"prefill": 30000, "decode": 30001}  # the entrypoint's defaults
NCCL_PORT = {"prefill": 31000, "decode": 31001}  # distinct: both roles may share a node's ports
DIST_INIT_PORT = {"prefill": 20000, "decode": 20001}  # an engine's rendezvous across nodes
BOOTSTRAP_PORT = 8998  # the entrypoint's DISAGG_BOOTSTRAP_PORT default
ROUTER_PORT = 8000
LWS_API = "leaderworkerset.x-k8s.io/v1"
ANNOTATION = "sglang-dsv4"  # prefix of the annotations this command writes
# A server's start-up probe outlasts the router's wait for it (sglang_router's
# --worker-startup-timeout-secs default, which the entrypoint keeps) by a stated margin: the
# router gives up on a server that is still loading weights and compiling kernels before
# Kubernetes would kill it, never at the same moment.
ROUTER_WORKER_STARTUP_S = 1800
STARTUP_MARGIN_S = 600
STARTUP_SECONDS = ROUTER_WORKER_STARTUP_S + STARTUP_MARGIN_S
# Upstream's /health waits up to SGLANG_HEALTH_CHECK_TIMEOUT (20 s) for a busy server's health
# generation; the liveness probe waits longer, so a busy server is not restarted.
UPSTREAM_HEALTH_CHECK_TIMEOUT_S = 20
LIVENESS_TIMEOUT_S = UPSTREAM_HEALTH_CHECK_TIMEOUT_S + 10
# The node rank of an engine spanning nodes, from the label LeaderWorkerSet puts on every pod of
# a group (all its releases), not from the LWS_WORKER_INDEX variable that older releases do not
# inject.
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
NODE_RANK_VARIABLE = "SGLANG_DSV4_NODE_RANK"
HICACHE_FLAGS = ("ratio", "size", "write_policy", "io_backend", "mem_layout")
QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
LABEL_KEY = re.compile(
    r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
)
LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
RESOURCE_NAME = re.compile(
    r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
)

# Comments written beside the fields they explain (first matching line of each object).
NOTES = {
    "hostNetwork: true": "NIXL/UCX and the bootstrap port on the node's own interfaces; the "
    "container ports become host ports, so the scheduler keeps two servers of a role off one node",
    "dnsPolicy: ClusterFirstWithHostNet": "cluster DNS on the host network: the servers resolve "
    "each other's Service names",
    "- IPC_LOCK": "for a root process only: under user 1001 the locked-memory limit RDMA "
    "registration needs is the container runtime's (docker/README.md)",
    "medium: Memory": "/dev/shm for the tensor-parallel ranks (Docker's --ipc host); counts "
    "towards the pod's memory",
    "publishNotReadyAddresses: true": "DNS names exist while servers load: the router waits for "
    "/health itself",
    "k8s.v1.cni.cncf.io/networks:": "Multus: attaches the RDMA network to the pod (its "
    "NetworkAttachmentDefinition must exist in this namespace)",
    "restartPolicy: RecreateGroupOnPodRestart": "one engine's ranks live and die together",
}


class K8sError(ValueError):
    """Input the manifests cannot be made from; its message is the one line the user reads."""


@dataclass
class Options:
    """What the manifests are made of: the plan's options and the cluster's."""

    gpu: str = "rtx-pro-6000"
    tp: int = 4
    prefill_tp: int | None = None
    decode_tp: int | None = None
    gpus_per_node: int = 4
    index_k_dtype: str = "bf16"
    context: int | None = None
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None
    weights_gib: float | None = None
    mtp: bool = False
    model: str | None = None  # the plan's local config folder
    replicas: dict = field(default_factory=lambda: {"prefill": 1, "decode": 1, "router": 1})
    hicache: tuple = ()  # roles with HiCache on
    hicache_settings: dict = field(default_factory=dict)  # HICACHE_* values
    name: str = "sglang-dsv4"
    namespace: str = "sglang-dsv4"
    image: str = f"sglang-dsv4-sm120:{__version__}"  # the image of this release, not :latest
    model_path: str = "/model"
    model_volume: str = "pvc:sglang-dsv4-model"
    create_pvc: str | None = None  # a size: write the --model-volume claim too
    storage_class: str | None = None  # of the claim --create-pvc writes
    shm_size: str = "32Gi"
    host_network: bool = False
    ib_device: str | None = None
    rdma_resources: dict = field(default_factory=dict)  # resource name -> count per pod
    network_attachment: str | None = None
    router_service_type: str = "ClusterIP"
    node_selector: dict = field(default_factory=dict)  # label -> value, for the GPU servers
    tolerations: list = field(default_factory=list)  # Kubernetes toleration objects
    image_pull_secret: str | None = None
    hf_token_secret: str | None = None  # a Secret whose key "token" the servers read as HF_TOKEN
    cluster_domain: str = "cluster.local"

    def role_tp(self, role: str) -> int:
        return {"prefill": self.prefill_tp, "decode": self.decode_tp}[role] or self.tp


# --- checks -------------------------------------------------------------------------------------


def check(options: Options) -> None:
    """Refuse what the cluster or the entrypoint would refuse later, in one line."""
    if not DNS_LABEL.fullmatch(options.namespace) or len(options.namespace) > 63:
        raise K8sError(f"--namespace {options.namespace!r}: not a DNS label (a-z, 0-9, '-')")
    # Pod names (NAME-decode-12-3) and StatefulSet revision labels must stay under 63 characters.
    if not DNS_LABEL.fullmatch(options.name) or len(options.name) > 40:
        raise K8sError(f"--name {options.name!r}: a DNS label of at most 40 characters")
    if not options.image.strip():
        raise K8sError("--image is empty")
    if not QUANTITY.fullmatch(options.shm_size):
        raise K8sError(f"--shm-size {options.shm_size!r}: a Kubernetes quantity such as 32Gi")
    for flag, value in (
        ("--context", options.context),
        ("--max-running-requests", options.max_running_requests),
    ):
        if value is not None and value < 1:
            raise K8sError(f"{flag} {value}: must be at least 1")
    fraction = options.mem_fraction_static
    if fraction is not None and not 0 < fraction <= 1:
        raise K8sError(f"--mem-fraction-static {fraction:g}: must be in (0, 1]")
    if options.weights_gib is not None and not options.weights_gib > 0:
        raise K8sError(f"--weights-gib {options.weights_gib:g}: must be positive")
    if options.gpus_per_node < 1:
        raise K8sError(f"--gpus-per-node {options.gpus_per_node}: must be at least 1")
    for role in ROLES:
        tp = options.role_tp(role)
        if tp < 1:
            raise K8sError(f"{role} TP {tp}: must be at least 1")
        if tp > options.gpus_per_node and tp % options.gpus_per_node:
            raise K8sError(
                f"{role} TP {tp} spans nodes of {options.gpus_per_node} GPUs but is not a "
                f"multiple of {options.gpus_per_node}: every node of one engine needs the same "
                "number of ranks"
            )
    for role, count in options.replicas.items():
        if count < 1:
            raise K8sError(f"--{role}-replicas {count}: must be at least 1")
    kind, _, source = options.model_volume.partition(":")
    if kind == "pvc":
        if not DNS_LABEL.fullmatch(source):
            raise K8sError(f"--model-volume {options.model_volume!r}: pvc:NAME with a DNS label")
    elif kind == "hostpath":
        if not source.startswith("/"):
            raise K8sError(f"--model-volume {options.model_volume!r}: hostpath:/ABSOLUTE/PATH")
    elif options.model_volume != "none":
        raise K8sError(f"--model-volume {options.model_volume!r}: pvc:NAME, hostpath:/PATH or none")
    if options.create_pvc is not None:
        if kind != "pvc":
            raise K8sError(
                f"--create-pvc writes the claim of --model-volume pvc:NAME, not of "
                f"{options.model_volume!r}"
            )
        if not QUANTITY.fullmatch(options.create_pvc):
            raise K8sError(f"--create-pvc {options.create_pvc!r}: a Kubernetes quantity, e.g. 1Ti")
    if options.storage_class is not None and options.create_pvc is None:
        raise K8sError("--storage-class names the class of the claim --create-pvc writes: add it")
    if kind in ("pvc", "hostpath") and not options.model_path.startswith("/"):
        raise K8sError(
            f"--model-path {options.model_path!r}: the mount point of --model-volume, an absolute "
            "path (a Hugging Face id needs --model-volume none)"
        )
    if options.ib_device and ":" in options.ib_device:
        raise K8sError(
            f"--ib-device {options.ib_device!r}: HCA names without a port (mlx5_0, not mlx5_0:1)"
        )
    if options.ib_device and not options.rdma_resources:
        raise K8sError(
            f"--ib-device {options.ib_device} gives the pods no RDMA device: add --rdma-resource "
            "NAME=COUNT, the RDMA device plugin's resource that mounts /dev/infiniband (e.g. "
            "rdma/rdma_shared_device_a=1)"
        )
    for name, count in options.rdma_resources.items():
        if not RESOURCE_NAME.fullmatch(name) or count < 1:
            raise K8sError(
                f"--rdma-resource {name}={count}: DOMAIN/NAME=COUNT, e.g. "
                "rdma/rdma_shared_device_a=1"
            )
    for flag, secret in (
        ("--image-pull-secret", options.image_pull_secret),
        ("--hf-token-secret", options.hf_token_secret),
    ):
        if secret is not None and not DNS_SUBDOMAIN.fullmatch(secret):
            raise K8sError(f"{flag} {secret!r}: the name of a Secret (a-z, 0-9, '-', '.')")
    if options.network_attachment is not None and not options.network_attachment.strip():
        raise K8sError("--network-attachment is empty")
    if options.hicache_settings and not options.hicache:
        names = ", ".join(f"--hicache-{k.replace('_', '-')}" for k in options.hicache_settings)
        raise K8sError(f"{names} given but HiCache is off (add --hicache prefill and/or decode)")
    if options.router_service_type not in ("ClusterIP", "NodePort", "LoadBalancer"):
        raise K8sError(
            f"--router-service-type {options.router_service_type!r}: ClusterIP, NodePort or "
            "LoadBalancer"
        )


# --- the plan -----------------------------------------------------------------------------------


def plans(options: Options) -> dict[str, dict]:
    """The memory plan of each serving role, as `sglang-dsv4 plan --disaggregation-mode ROLE`
    with the same options computes it (upstream's plugins loaded first, as a server does)."""
    from sglang.srt.plugins import load_plugins

    from sglang_dsv4.plan import plan

    load_plugins()
    found = {}
    for role in ROLES:
        tp = options.role_tp(role)
        found[role] = plan(
            options.index_k_dtype,
            model_path=options.model,
            tp=tp,
            disaggregation_mode=role,
            gpu=options.gpu,
            mem_fraction_static=options.mem_fraction_static,
            weights_gib=options.weights_gib,
            max_running_requests=options.max_running_requests,
            mtp=options.mtp,
            context=options.context,
            gpus=tp * options.replicas[role],
            index_k_source="--index-k-dtype",
        )
    return found


def plan_command(options: Options, role: str) -> str:
    """The `sglang-dsv4 plan` command that prints this role's figures."""
    words = ["sglang-dsv4", "plan", "--disaggregation-mode", role]
    words += ["--gpu", options.gpu, "--tp", str(options.role_tp(role))]
    words += ["--index-k-dtype", options.index_k_dtype]
    if options.model:
        words += ["--model", str(options.model)]
    if options.mem_fraction_static is not None:
        words += ["--mem-fraction-static", f"{options.mem_fraction_static:g}"]
    if options.weights_gib is not None:
        words += ["--weights-gib", f"{options.weights_gib:g}"]
    if options.max_running_requests is not None:
        words += ["--max-running-requests", str(options.max_running_requests)]
    if options.mtp:
        words.append("--mtp")
    if options.context:
        words += ["--context", str(options.context)]
        words += ["--gpus", str(options.role_tp(role) * options.replicas[role])]
    return " ".join(words)


def plan_annotations(p: dict) -> dict[str, str]:
    """The plan's figures of one role, on its pods."""
    figures = {
        "gpu": p["gpu"],
        "tp": p["tp"],
        "index-k-dtype": p["index_k_dtype"],
        "mem-fraction-static": p["mem_fraction_static"],
        "kv-memory-bytes": p["kv_memory_bytes"],
        "max-total-num-tokens": p["max_total_num_tokens"],
        "max-running-requests": p["max_running_requests"],
    }
    if "sessions" in p:
        figures["context"] = p["context"]
        figures["sessions-per-rank"] = p["sessions"]["per_rank"]
        figures["sessions-deployment"] = p["sessions"]["deployment"]
    return {
        f"{ANNOTATION}/plan-{k}": f"{v:g}" if isinstance(v, float) else str(v)
        for k, v in figures.items()
        if v is not None
    }


# --- objects ------------------------------------------------------------------------------------


def _labels(options: Options, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "sglang-dsv4",
        "app.kubernetes.io/instance": options.name,
        "app.kubernetes.io/component": component,
    }


def _meta(options: Options, name: str, component: str, **extra) -> dict:
    return {
        "name": name,
        "namespace": options.namespace,
        "labels": _labels(options, component),
        **extra,
    }


def nodes_per_engine(options: Options, role: str) -> int:
    tp = options.role_tp(role)
    return 1 if tp <= options.gpus_per_node else tp // options.gpus_per_node


def server_dns(options: Options, role: str, index: int) -> str:
    """The DNS name of replica `index` of a role (its leader, for an engine spanning nodes).

    A StatefulSet's pods are NAME-i under its headless Service NAME; a LeaderWorkerSet's leaders
    are named alike under the headless Service it makes (subdomain policy Shared)."""
    group = f"{options.name}-{role}"
    return f"{group}-{index}.{group}.{options.namespace}.svc.{options.cluster_domain}"


def server_environment(options: Options, role: str, p: dict) -> dict[str, str]:
    """The role's image environment: the plan's launch section, where the pod finds things."""
    env = dict(p["launch"]["image_environment"])
    env["MODEL_PATH"] = options.model_path
    env["PORT"] = str(HTTP_PORT[role])
    if role == "prefill":
        env["DISAGG_BOOTSTRAP_PORT"] = str(BOOTSTRAP_PORT)
    if options.host_network:
        env["NCCL_PORT"] = str(NCCL_PORT[role])
    if options.ib_device:
        env["IB_DEVICE"] = options.ib_device
    if role in options.hicache:
        env["ENABLE_HICACHE"] = "1"
        for key, value in options.hicache_settings.items():
            env[f"HICACHE_{key.upper()}"] = str(value)
    return env


def router_environment(options: Options) -> dict[str, str]:
    prefill = [
        f"http://{server_dns(options, 'prefill', i)}:{HTTP_PORT['prefill']}@{BOOTSTRAP_PORT}"
        for i in range(options.replicas["prefill"])
    ]
    decode = [
        f"http://{server_dns(options, 'decode', i)}:{HTTP_PORT['decode']}"
        for i in range(options.replicas["decode"])
    ]
    return {
        "PREFILL_URLS": ",".join(prefill),
        "DECODE_URLS": ",".join(decode),
        "PORT": str(ROUTER_PORT),
    }


def config_map(options: Options, name: str, component: str, data: dict[str, str]) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(options, name, component),
        "data": data,
    }


def _digest(data: dict[str, str]) -> str:
    text = "\n".join(f"{k}={v}" for k, v in sorted(data.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _probe(path: str, port: str, period: int, failures: int, timeout: int = 10) -> dict:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def _volumes(options: Options) -> tuple[list, list]:
    volumes = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": options.shm_size}},
        {"name": "cache", "emptyDir": {}},
    ]
    mounts = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "cache", "mountPath": "/home/sglang/.cache"},
    ]
    kind, _, source = options.model_volume.partition(":")
    if kind == "pvc":
        volumes.append(
            {"name": "model", "persistentVolumeClaim": {"claimName": source, "readOnly": True}}
        )
    elif kind == "hostpath":
        volumes.append({"name": "model", "hostPath": {"path": source, "type": "Directory"}})
    if kind in ("pvc", "hostpath"):
        mounts.append({"name": "model", "mountPath": options.model_path, "readOnly": True})
    return volumes, mounts


def server_pod(
    options: Options,
    role: str,
    p: dict,
    env_name: str,
    env_digest: str,
    *,
    node_rank: str | None = None,
) -> dict:
    """The pod template of one server (or one node of an engine spanning nodes)."""
    nnodes = nodes_per_engine(options, role)
    gpus = options.role_tp(role) // nnodes
    args = [role]
    if nnodes > 1:
        # LeaderWorkerSet sets these variables in every container of a group; Kubernetes expands
        # $(NAME) in args. Upstream's multi-node flags, after the role: the entrypoint appends them.
        args += [
            "--nnodes",
            "$(LWS_GROUP_SIZE)",
            "--node-rank",
            f"$({NODE_RANK_VARIABLE})",
            "--dist-init-addr",
            f"$(LWS_LEADER_ADDRESS):{DIST_INIT_PORT[role]}",
        ]
    limits = {"nvidia.com/gpu": gpus, **options.rdma_resources}
    ports = [{"name": "http", "containerPort": HTTP_PORT[role]}]
    if role == "prefill" and node_rank != "worker":
        ports.append({"name": "bootstrap", "containerPort": BOOTSTRAP_PORT})
    if nnodes > 1 and node_rank != "worker":
        ports.append({"name": "dist-init", "containerPort": DIST_INIT_PORT[role]})
    # A node other than an engine's first answers /health from a stand-in server (no /ready).
    ready_path = "/health" if node_rank == "worker" else "/ready"
    volumes, mounts = _volumes(options)
    security = {
        "runAsNonRoot": True,
        "runAsUser": IMAGE_UID,
        "runAsGroup": IMAGE_UID,
        "allowPrivilegeEscalation": False,
    }
    if options.ib_device or options.rdma_resources:
        security["capabilities"] = {"add": ["IPC_LOCK"]}
    # The address this server advertises to its PD peers (upstream's SGLANG_HOST_IP).
    env = [{"name": "SGLANG_HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    if nnodes > 1:
        label = f"metadata.labels['{WORKER_INDEX_LABEL}']"
        env.append({"name": NODE_RANK_VARIABLE, "valueFrom": {"fieldRef": {"fieldPath": label}}})
    if options.hf_token_secret:
        secret = {"name": options.hf_token_secret, "key": "token"}
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": secret}})
    container = {
        "name": role,
        "image": options.image,
        "imagePullPolicy": "IfNotPresent",
        "args": args,
        "envFrom": [{"configMapRef": {"name": env_name}}],
        "env": env,
        "ports": ports,
        "resources": {
            "limits": dict(limits),
            "requests": {**limits, **host_requests(options, role, p, gpus)},
        },
        "startupProbe": _probe("/health", "http", 30, STARTUP_SECONDS // 30),
        "livenessProbe": _probe("/health", "http", 30, 3, timeout=LIVENESS_TIMEOUT_S),
        "readinessProbe": _probe(ready_path, "http", 10, 3, timeout=5),
        "volumeMounts": mounts,
        "securityContext": security,
    }
    annotations = {**plan_annotations(p), f"{ANNOTATION}/config-sha256": env_digest}
    if options.network_attachment:
        annotations["k8s.v1.cni.cncf.io/networks"] = options.network_attachment
    spec = {
        "securityContext": {"fsGroup": IMAGE_UID},
        "terminationGracePeriodSeconds": 60,
        "containers": [container],
        "volumes": volumes,
        **_scheduling(options, role),
    }
    if options.host_network:
        spec["hostNetwork"] = True
        spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    return {
        "metadata": {"labels": _labels(options, role), "annotations": annotations},
        "spec": spec,
    }


# A rank's host memory besides /dev/shm and HiCache: torch, the CUDA context, pinned staging
# buffers, the tokenizer and detokenizer for the first rank. An estimate to replace with the GPU
# proof kit's measurement; requests place pods (Burstable QoS, not first evicted), they limit
# nothing, so no memory limit is set on a server.
RANK_HOST_MEMORY = 8 * 2**30
UPSTREAM_HICACHE_RATIO = 2.0  # upstream's --hicache-ratio when a prefill gives none
_QUANTITY_FACTORS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
                     "E": 10**18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
                     "Pi": 2**50, "Ei": 2**60}  # fmt: skip


def quantity_bytes(quantity: str) -> int:
    number = re.match(r"[0-9.]+", quantity)[0]
    return int(float(number) * _QUANTITY_FACTORS[quantity[len(number) :]])


def hicache_host_bytes(options: Options, role: str, p: dict, ranks: int) -> int:
    """HiCache's host pool of the pod's ranks: --hicache-size (GB per rank), else the ratio to
    the device KV pool (--hicache-ratio, upstream's 2.0 on a prefill). A decode given neither
    sizes it from the host's free memory at start-up: nothing to price here."""
    if role not in options.hicache:
        return 0
    size, ratio = options.hicache_settings.get("size"), options.hicache_settings.get("ratio")
    if size is not None and float(size) > 0:
        return int(float(size) * 10**9) * ranks
    if ratio is None and role == "prefill":
        ratio = UPSTREAM_HICACHE_RATIO
    return int(float(ratio) * p["kv_memory_bytes"]) * ranks if ratio is not None else 0


def host_requests(options: Options, role: str, p: dict, ranks: int) -> dict[str, str]:
    """CPU and memory a server pod requests: a core per rank and two for the HTTP server and
    detokenizer; memory for /dev/shm (memory-backed), each rank and HiCache's host pool."""
    memory = quantity_bytes(options.shm_size) + RANK_HOST_MEMORY * ranks
    memory += hicache_host_bytes(options, role, p, ranks)
    return {"cpu": str(ranks + 2), "memory": f"{-(-memory // 2**30)}Gi"}


def _scheduling(options: Options, component: str) -> dict:
    """Where a pod may run: the GPU nodes (--node-selector, --toleration) for servers, apart from
    the other replicas of its component where the cluster allows, with the pull secret."""
    spec: dict = {
        "affinity": {
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 100,
                        "podAffinityTerm": {
                            "labelSelector": {"matchLabels": _labels(options, component)},
                            "topologyKey": "kubernetes.io/hostname",
                        },
                    }
                ]
            }
        }
    }
    gpu_nodes = component in ROLES
    if gpu_nodes and options.node_selector:
        spec["nodeSelector"] = dict(options.node_selector)
    if gpu_nodes and options.tolerations:
        spec["tolerations"] = [dict(t) for t in options.tolerations]
    if options.image_pull_secret:
        spec["imagePullSecrets"] = [{"name": options.image_pull_secret}]
    return spec


def model_claim(options: Options) -> dict:
    """The weights' claim (--create-pvc). Every server pod mounts it read-only, from several
    nodes at once, so it is ReadWriteMany: a job can fill it while the servers read it (a
    ReadWriteOnce claim attaches to one node: the next server pod would stay Pending)."""
    spec: dict = {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": options.create_pvc}},
    }
    if options.storage_class:
        spec["storageClassName"] = options.storage_class
    name = options.model_volume.partition(":")[2]
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _meta(options, name, "model"),
        "spec": spec,
    }


def disruption_budget(options: Options, component: str) -> dict:
    """A node drain takes at most one pod of a component at a time."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(options, f"{options.name}-{component}", component),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _labels(options, component)}},
    }


def headless_service(options: Options, role: str) -> dict:
    group = f"{options.name}-{role}"
    ports = [{"name": "http", "port": HTTP_PORT[role], "targetPort": "http"}]
    if role == "prefill":
        ports.append({"name": "bootstrap", "port": BOOTSTRAP_PORT, "targetPort": "bootstrap"})
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(options, group, role),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": _labels(options, role),
            "ports": ports,
        },
    }


def server_objects(options: Options, role: str, p: dict) -> list[dict]:
    group = f"{options.name}-{role}"
    env = server_environment(options, role, p)
    env_name = f"{group}-env"
    digest = _digest(env)
    objects = [config_map(options, env_name, role, env), disruption_budget(options, role)]
    replicas = options.replicas[role]
    nnodes = nodes_per_engine(options, role)
    if nnodes == 1:
        objects.append(headless_service(options, role))
        objects.append(
            {
                "apiVersion": "apps/v1",
                "kind": "StatefulSet",
                "metadata": _meta(options, group, role),
                "spec": {
                    "serviceName": group,
                    "replicas": replicas,
                    # Servers start and stop independently; each loads its own weights.
                    "podManagementPolicy": "Parallel",
                    "selector": {"matchLabels": _labels(options, role)},
                    "template": server_pod(options, role, p, env_name, digest),
                },
            }
        )
        return objects
    objects.append(
        {
            "apiVersion": LWS_API,
            "kind": "LeaderWorkerSet",
            "metadata": _meta(options, group, role),
            "spec": {
                "replicas": replicas,
                "startupPolicy": "LeaderCreated",
                "leaderWorkerTemplate": {
                    "size": nnodes,
                    "restartPolicy": "RecreateGroupOnPodRestart",
                    "leaderTemplate": server_pod(
                        options, role, p, env_name, digest, node_rank="leader"
                    ),
                    "workerTemplate": server_pod(
                        options, role, p, env_name, digest, node_rank="worker"
                    ),
                },
                "networkConfig": {"subdomainPolicy": "Shared"},
            },
        }
    )
    return objects


def router_objects(options: Options) -> list[dict]:
    name = f"{options.name}-router"
    env = router_environment(options)
    labels = _labels(options, "router")
    return [
        config_map(options, f"{name}-env", "router", env),
        disruption_budget(options, "router"),
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": _meta(options, name, "router"),
            "spec": {
                "replicas": options.replicas["router"],
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {
                        "labels": labels,
                        "annotations": {f"{ANNOTATION}/config-sha256": _digest(env)},
                    },
                    "spec": {
                        "containers": [
                            {
                                "name": "router",
                                "image": options.image,
                                "imagePullPolicy": "IfNotPresent",
                                "args": ["router"],
                                "envFrom": [{"configMapRef": {"name": f"{name}-env"}}],
                                "ports": [{"name": "http", "containerPort": ROUTER_PORT}],
                                "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},
                                # The router's own endpoints: alive, and ready once it has healthy
                                # prefill and decode servers.
                                "livenessProbe": _probe("/liveness", "http", 15, 3, timeout=5),
                                "readinessProbe": _probe("/readiness", "http", 10, 3, timeout=5),
                                "securityContext": {
                                    "runAsNonRoot": True,
                                    "runAsUser": IMAGE_UID,
                                    "runAsGroup": IMAGE_UID,
                                    "allowPrivilegeEscalation": False,
                                },
                            }
                        ],
                        **_scheduling(options, "router"),
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(options, name, "router"),
            "spec": {
                "type": options.router_service_type,
                "selector": labels,
                "ports": [{"name": "http", "port": ROUTER_PORT, "targetPort": "http"}],
            },
        },
    ]


# --- files --------------------------------------------------------------------------------------


class _Dumper(yaml.SafeDumper):
    """Plain YAML: a mapping used twice (selector and pod labels) is written out twice."""

    def ignore_aliases(self, data):
        return True


def _dump(obj: dict) -> str:
    """One object as YAML, with NOTES written beside the fields they explain."""
    lines = yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=100).splitlines()
    for needle, note in NOTES.items():
        for i, line in enumerate(lines):
            if line.strip().startswith(needle):
                lines[i] = f"{line}  # {note}"
                break
    return "\n".join(lines) + "\n"


def _header(lines: list[str]) -> str:
    return "".join(f"# {line}".rstrip() + "\n" for line in lines)


def render(options: Options, found: dict[str, dict]) -> dict[str, str]:
    """File name -> YAML text of every manifest."""
    files: dict[str, list] = {}
    headers: dict[str, list[str]] = {}
    if options.namespace != "default":
        files[NAMESPACE_FILE] = [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": options.namespace}}
        ]
        headers[NAMESPACE_FILE] = [f"{NAMESPACE_HEADER[2:]}{options.name}."]
    if options.create_pvc is not None:
        files[MODEL_FILE] = [model_claim(options)]
        headers[MODEL_FILE] = [
            f"{MODEL_HEADER[2:]}({options.create_pvc}, ReadWriteMany: every server mounts it "
            "read-only, from several nodes); fill it before the servers start."
        ]
    for number, role in ((10, "prefill"), (20, "decode")):
        p = found[role]
        nnodes = nodes_per_engine(options, role)
        shape = (
            f"one StatefulSet pod per server ({options.role_tp(role)} GPUs)"
            if nnodes == 1
            else f"one LeaderWorkerSet group of {nnodes} pods per server "
            f"({options.role_tp(role) // nnodes} GPUs each)"
        )
        name = f"{number}-{role}.yaml"
        files[name] = server_objects(options, role, p)
        headers[name] = [
            f"{role}: {options.replicas[role]} x TP {p['tp']} on {p['gpu']}, {shape}.",
            f"Figures from the memory plan: {plan_command(options, role)}",
            f"  mem-fraction-static {p['mem_fraction_static']:g}, KV memory "
            f"{p['kv_memory_bytes']:,} B per rank, max total tokens {p['max_total_num_tokens']:,}, "
            f"max running requests {p['max_running_requests']}, index-K {p['index_k_dtype']}",
        ]
        if "sessions" in p:
            s = p["sessions"]
            headers[name].append(
                f"  sessions of {p['context']:,} tokens: {s['per_rank']:,} per rank "
                f"(limited by {s['limited_by']}), {s['deployment']:,} for this role"
            )
        if nnodes > 1:
            headers[name].append(
                f"Needs the LeaderWorkerSet controller ({LWS_API}); it makes the headless "
                f"Service {options.name}-{role} the router addresses leaders through."
            )
    files["30-router.yaml"] = router_objects(options)
    headers["30-router.yaml"] = [
        "The router (sglang_router, PD mode) with every prefill server (HTTP URL and bootstrap "
        "port) and decode server by its DNS name;",
        "change a role's replica count by rendering again, so this list follows.",
    ]
    return {
        name: _header(headers[name]) + "".join(f"---\n{_dump(obj)}" for obj in objs)
        for name, objs in files.items()
    }


NAMESPACE_FILE = "00-namespace.yaml"
MODEL_FILE = "05-model.yaml"
MODEL_HEADER = "# The weights' claim "
NAMESPACE_HEADER = "# The namespace of the deployment "


def write(out: Path, rendered: dict[str, str]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    # A Namespace (or claim) this command wrote before, for a deployment now in `default` (or
    # without --create-pvc), would be applied with the rest: remove it (only a file this command
    # wrote).
    for name, header in ((NAMESPACE_FILE, NAMESPACE_HEADER), (MODEL_FILE, MODEL_HEADER)):
        stale = out / name
        if name not in rendered and stale.is_file() and stale.read_text().startswith(header):
            stale.unlink()
    paths = []
    for name, text in rendered.items():
        path = out / name
        path.write_text(text)
        paths.append(path)
    return paths
