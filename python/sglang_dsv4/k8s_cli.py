"""`sglang-dsv4 k8s`'s command line: its options, their parsing into `k8s.Options`, the run.

The manifests themselves are made in `sglang_dsv4.k8s`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from sglang_dsv4.k8s import (
    HICACHE_FLAGS,
    LABEL_KEY,
    LABEL_VALUE,
    ROLES,
    TAINT_EFFECTS,
    K8sError,
    Options,
    check,
    plans,
    render,
    write,
)

# --- command line -------------------------------------------------------------------------------


def add_arguments(parser) -> None:
    parser.add_argument("--out", required=True, metavar="DIR", help="folder to write the YAML to")
    plan_group = parser.add_argument_group("the memory plan (as `sglang-dsv4 plan`)")
    plan_group.add_argument(
        "--gpu", default=Options.gpu, help=f"GPU model or memory size (default: {Options.gpu})"
    )
    plan_group.add_argument(
        "--tp",
        type=int,
        default=Options.tp,
        help=f"tensor-parallel size of each server (default: {Options.tp})",
    )
    plan_group.add_argument("--prefill-tp", type=int, metavar="N", help="prefill's, if not --tp")
    plan_group.add_argument("--decode-tp", type=int, metavar="N", help="decode's, if not --tp")
    plan_group.add_argument(
        "--index-k-dtype",
        default=Options.index_k_dtype,
        metavar="{fp8,bf16,fp4}",
        help="c4 indexer key storage, both roles (default: bf16, the image's)",
    )
    plan_group.add_argument(
        "--context",
        type=int,
        metavar="N",
        help="tokens per session: sessions per rank and per role, annotated",
    )
    plan_group.add_argument(
        "--mem-fraction-static",
        type=float,
        metavar="F",
        help="as the server flag (default: upstream's for GPU, TP and role)",
    )
    plan_group.add_argument(
        "--max-running-requests",
        type=int,
        metavar="N",
        help="as the server flag (default: upstream's)",
    )
    plan_group.add_argument(
        "--weights-gib",
        type=float,
        metavar="G",
        help="the whole checkpoint's size (default: as `plan`)",
    )
    plan_group.add_argument("--mtp", action="store_true", help="speculative decoding (EAGLE)")
    plan_group.add_argument(
        "--model",
        metavar="PATH",
        help="local folder with config.json the plan reads (default: the "
        "embedded DeepSeek-V4-Flash config)",
    )
    cluster = parser.add_argument_group("the cluster")
    cluster.add_argument(
        "--gpus-per-node",
        type=int,
        default=Options.gpus_per_node,
        help="GPUs of one node: a TP above it spans nodes (LeaderWorkerSet) "
        f"(default: {Options.gpus_per_node})",
    )
    for role in ("prefill", "decode", "router"):
        cluster.add_argument(
            f"--{role}-replicas",
            type=int,
            default=1,
            metavar="N",
            help=f"{role} servers (default: 1)" if role != "router" else "router pods (default: 1)",
        )
    cluster.add_argument("--name", default=Options.name, help="prefix of every object's name")
    cluster.add_argument(
        "--namespace",
        default=Options.namespace,
        help=f"(default: {Options.namespace}; written as a Namespace object unless 'default')",
    )
    cluster.add_argument(
        "--image",
        default=Options.image,
        help="the image built from docker/Dockerfile, in your registry",
    )
    cluster.add_argument(
        "--image-pull-secret",
        metavar="NAME",
        help="a docker-registry Secret in the namespace for pulling --image",
    )
    cluster.add_argument(
        "--hf-token-secret",
        metavar="NAME",
        help="a Secret in the namespace whose key 'token' the servers read as HF_TOKEN",
    )
    cluster.add_argument(
        "--node-selector",
        action="append",
        default=[],
        metavar="LABEL=VALUE",
        help="run the servers only on nodes with this label (repeat for more), e.g. "
        "nvidia.com/gpu.product=NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition",
    )
    cluster.add_argument(
        "--toleration",
        action="append",
        default=[],
        metavar="KEY[=VALUE]:EFFECT",
        help="let the servers onto nodes with this taint (repeat for more), e.g. "
        "nvidia.com/gpu:NoSchedule",
    )
    cluster.add_argument(
        "--model-path",
        default=Options.model_path,
        help="MODEL_PATH in the pods: where --model-volume is mounted "
        f"(default: {Options.model_path})",
    )
    cluster.add_argument(
        "--model-volume",
        default=Options.model_volume,
        help="pvc:NAME (read-only claim holding the weights), hostpath:/PATH "
        f"(the same folder on every GPU node) or none (default: "
        f"{Options.model_volume})",
    )
    cluster.add_argument(
        "--create-pvc",
        metavar="SIZE",
        help="also write the --model-volume claim (ReadWriteMany, this size, e.g. 1Ti); without "
        "it the claim must exist, mountable read-only on several nodes at once (ReadOnlyMany or "
        "ReadWriteMany)",
    )
    cluster.add_argument(
        "--storage-class",
        metavar="NAME",
        help="the StorageClass of the claim --create-pvc writes (default: the cluster's)",
    )
    cluster.add_argument(
        "--shm-size",
        default=Options.shm_size,
        help=f"/dev/shm of a server pod (default: {Options.shm_size})",
    )
    cluster.add_argument(
        "--router-service-type",
        default=Options.router_service_type,
        help="ClusterIP | NodePort | LoadBalancer (default: ClusterIP)",
    )
    cluster.add_argument(
        "--cluster-domain",
        default=Options.cluster_domain,
        help=f"the cluster's DNS domain (default: {Options.cluster_domain})",
    )
    hicache = parser.add_argument_group("HiCache (hierarchical KV cache in host memory)")
    hicache.add_argument(
        "--hicache",
        action="append",
        choices=ROLES,
        default=[],
        help="turn HiCache on for this role (repeat for both)",
    )
    for key in HICACHE_FLAGS:
        hicache.add_argument(
            f"--hicache-{key.replace('_', '-')}",
            dest=f"hicache_{key}",
            metavar="V",
            help=f"HICACHE_{key.upper()} of the image",
        )
    network = parser.add_argument_group("the KV transfer network (NIXL over UCX)")
    network.add_argument(
        "--host-network",
        action="store_true",
        help="servers on the nodes' network (RDMA NICs without a CNI for them)",
    )
    network.add_argument(
        "--ib-device",
        metavar="HCAS",
        help="IB_DEVICE of the image: RDMA devices for NIXL, e.g. mlx5_0",
    )
    network.add_argument(
        "--rdma-resource",
        action="append",
        default=[],
        metavar="NAME=COUNT",
        help="device-plugin resource per server pod, e.g. rdma/rdma_shared_device_a=1 (repeatable)",
    )
    network.add_argument(
        "--network-attachment",
        metavar="NAME",
        help="Multus network for the pods (k8s.v1.cni.cncf.io/networks)",
    )


def _node_selector(items: list[str]) -> dict[str, str]:
    selector = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not LABEL_KEY.fullmatch(key) or not LABEL_VALUE.fullmatch(value):
            raise K8sError(f"--node-selector {item!r}: LABEL=VALUE, e.g. gpu=rtx-pro-6000")
        selector[key] = value
    return selector


def _tolerations(items: list[str]) -> list[dict]:
    tolerations = []
    for item in items:
        taint, _, effect = item.rpartition(":")
        key, sep, value = taint.partition("=")
        if effect not in TAINT_EFFECTS or not LABEL_KEY.fullmatch(key):
            raise K8sError(
                f"--toleration {item!r}: KEY[=VALUE]:EFFECT with EFFECT one of "
                f"{', '.join(TAINT_EFFECTS)}, e.g. nvidia.com/gpu:NoSchedule"
            )
        toleration = {"key": key, "operator": "Equal" if sep else "Exists", "effect": effect}
        if sep:
            toleration["value"] = value
        tolerations.append(toleration)
    return tolerations


def options_from(args) -> Options:
    rdma = {}
    for item in args.rdma_resource:
        name, sep, count = item.partition("=")
        if not sep or not count.isdigit():
            raise K8sError(
                f"--rdma-resource {item!r}: NAME=COUNT, e.g. rdma/rdma_shared_device_a=1"
            )
        rdma[name] = int(count)
    settings = {
        key: getattr(args, f"hicache_{key}")
        for key in HICACHE_FLAGS
        if getattr(args, f"hicache_{key}") is not None
    }
    return Options(
        gpu=args.gpu,
        tp=args.tp,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        gpus_per_node=args.gpus_per_node,
        index_k_dtype=args.index_k_dtype,
        context=args.context,
        mem_fraction_static=args.mem_fraction_static,
        max_running_requests=args.max_running_requests,
        weights_gib=args.weights_gib,
        mtp=args.mtp,
        model=args.model,
        replicas={
            "prefill": args.prefill_replicas,
            "decode": args.decode_replicas,
            "router": args.router_replicas,
        },
        hicache=tuple(dict.fromkeys(args.hicache)),
        hicache_settings=settings,
        name=args.name,
        namespace=args.namespace,
        image=args.image,
        model_path=args.model_path,
        model_volume=args.model_volume,
        create_pvc=args.create_pvc,
        storage_class=args.storage_class,
        shm_size=args.shm_size,
        host_network=args.host_network,
        ib_device=args.ib_device,
        rdma_resources=rdma,
        network_attachment=args.network_attachment,
        router_service_type=args.router_service_type,
        cluster_domain=args.cluster_domain,
        node_selector=_node_selector(args.node_selector),
        tolerations=_tolerations(args.toleration),
        image_pull_secret=args.image_pull_secret,
        hf_token_secret=args.hf_token_secret,
    )


def run(args) -> int:
    from sglang_dsv4.cli import step
    from sglang_dsv4.plan import PlanError

    try:
        options = options_from(args)
        check(options)
        step("sglang-dsv4 k8s: the memory plan of prefill and decode")
        found = plans(options)
        rendered = render(options, found)
    except (K8sError, PlanError) as exc:
        print(f"sglang-dsv4 k8s: {exc}", file=sys.stderr)
        return 2
    except (AssertionError, ValueError, RuntimeError) as exc:
        line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"sglang-dsv4 k8s: upstream refused this configuration: {line}", file=sys.stderr)
        return 2
    try:
        paths = write(Path(args.out), rendered)
    except OSError as exc:
        print(f"sglang-dsv4 k8s: cannot write to {args.out}: {exc.strerror}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    print(f"apply with: kubectl apply -f {args.out}")
    return 0
