"""`sglang-dsv4 k8s`: the manifests, checked offline.

There is no cluster here. What decides whether the manifests would serve is checked instead:
every core object against the Kubernetes schemas that `kubernetes-validate` ships (strict: an
unknown field fails), the LeaderWorkerSet objects field by field against the LeaderWorkerSet v1
API, and for two sizes every pod's container run through the image's entrypoint (`--dry-run`) and
parsed by upstream's own parsers (sglang's ServerArgs, sglang_router's RouterArgs), so the plan's
figures are checked where upstream's launcher reads them. The figures are compared with what
`sglang-dsv4 plan --json` prints for the command the manifest names.
"""

from __future__ import annotations

import copy
import json
import math
import re
import shlex
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import sglang_dsv4
import test_docker
import yaml
from sglang_dsv4 import k8s
from sglang_dsv4.cli import main
from test_docker import dry_run, router_argv, server_argv

# The entrypoint's dry run and upstream's parsers (fixtures), as the compose tests use them.
parse_server = test_docker.parse_server
parse_router = test_docker.parse_router

LWS_API = "leaderworkerset.x-k8s.io/v1"
CORE_KINDS = {
    "Namespace", "ConfigMap", "Service", "StatefulSet", "Deployment", "PodDisruptionBudget",
    "PersistentVolumeClaim",
}
SIZES = {
    # One engine per node: StatefulSets, the defaults (4 RTX PRO 6000 per node, TP 4).
    "one-node": ["--create-pvc", "1Ti", "--storage-class", "nfs-rwx"],
    # Prefill at TP 8 across two 4-GPU nodes (LeaderWorkerSet), decode at TP 4, more replicas,
    # HiCache on prefill, host network with RDMA, fp8 index keys, MTP, sessions.
    "across-nodes": [
        "--gpu", "h200", "--tp", "8", "--decode-tp", "4", "--gpus-per-node", "4",
        "--index-k-dtype", "fp8", "--context", "65536", "--mtp",
        "--prefill-replicas", "2", "--decode-replicas", "3", "--router-replicas", "2",
        "--hicache", "prefill", "--hicache-ratio", "2", "--hicache-write-policy", "write_back",
        "--host-network", "--ib-device", "mlx5_0", "--rdma-resource", "rdma/rdma_shared_device_a=1",
        "--network-attachment", "rdma-net", "--namespace", "llm", "--name", "dsv4",
        "--model-path", "/weights/v4", "--model-volume", "hostpath:/srv/models/v4",
        "--node-selector", "nvidia.com/gpu.product=NVIDIA-H200", "--node-selector", "pool=gpu",
        "--toleration", "nvidia.com/gpu:NoSchedule", "--toleration", "dedicated=llm:NoExecute",
        "--image-pull-secret", "registry-creds", "--hf-token-secret", "hf-token",
    ],
}  # fmt: skip


def render(tmp_path_factory, args: list[str]):
    out = tmp_path_factory.mktemp("manifests")
    assert main(["k8s", "--out", str(out), *args]) == 0
    files = {path.name: path.read_text() for path in sorted(out.glob("*.yaml"))}
    docs = [doc for text in files.values() for doc in yaml.safe_load_all(text) if doc]
    return files, docs


@pytest.fixture(scope="module", params=sorted(SIZES))
def manifests(request, tmp_path_factory):
    files, docs = render(tmp_path_factory, SIZES[request.param])
    return request.param, files, docs


def find(docs, kind, name=None):
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    return found


def one(docs, kind, name):
    (doc,) = find(docs, kind, name)
    return doc


def plan_of(files: dict, role: str, capsys) -> dict:
    """`sglang-dsv4 plan --json` run with the command the manifest's header names for `role`."""
    (text,) = [t for name, t in files.items() if name.endswith(f"-{role}.yaml")]
    (line,) = [ln for ln in text.splitlines() if "Figures from the memory plan:" in ln]
    words = shlex.split(line.split(":", 1)[1])
    assert words[:2] == ["sglang-dsv4", "plan"], words
    capsys.readouterr()
    assert main([*words[1:], "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(NAME) expansion in a container's args."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m[1]], value)


def groups(docs, role):
    """(workload, [(pod template, node rank)], nodes per engine) of a serving role."""
    (workload,) = [
        d
        for d in docs
        if d["kind"] in ("StatefulSet", "LeaderWorkerSet")
        and d["metadata"]["labels"]["app.kubernetes.io/component"] == role
    ]
    if workload["kind"] == "StatefulSet":
        return workload, [(workload["spec"]["template"], 0)], 1
    lwt = workload["spec"]["leaderWorkerTemplate"]
    size = lwt["size"]
    pods = [(lwt["leaderTemplate"], 0)] + [(lwt["workerTemplate"], r) for r in range(1, size)]
    return workload, pods, size


def container_env(docs, pod: dict, extra: dict[str, str], node_rank: int = 0) -> dict[str, str]:
    """The variables the container starts with: its ConfigMaps, then its own env (pod fields as
    Kubernetes fills them: a stand-in address, the worker-index label LWS puts on the pod)."""
    (container,) = pod["spec"]["containers"]
    env = {}
    for source in container.get("envFrom", []):
        env.update(one(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    fields = {
        "status.podIP": "10.0.0.7",
        "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']": str(node_rank),
    }
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        elif "secretKeyRef" in item["valueFrom"]:
            env[item["name"]] = "secret"  # a stand-in: what the Secret holds
        else:
            env[item["name"]] = fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
    return {**env, **extra}


def leader_dns(docs, role: str, index: int) -> str:
    """The DNS name Kubernetes gives replica `index` of a role (its leader across nodes)."""
    workload, _, _ = groups(docs, role)
    name, ns = workload["metadata"]["name"], workload["metadata"]["namespace"]
    if workload["kind"] == "StatefulSet":
        service = one(docs, "Service", workload["spec"]["serviceName"])
        assert service["spec"]["clusterIP"] == "None"  # headless: one name per pod
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
        return f"{name}-{index}.{service['metadata']['name']}.{ns}.svc.cluster.local"
    # LeaderWorkerSet, subdomain policy Shared: leaders NAME-i under its own headless Service NAME.
    assert workload["spec"]["networkConfig"]["subdomainPolicy"] == "Shared"
    return f"{name}-{index}.{name}.{ns}.svc.cluster.local"


# --- schemas -----------------------------------------------------------------------------------


def schema_versions() -> list[str]:
    # The oldest cluster LeaderWorkerSet supports, and the newest schemas shipped.
    return ["1.29", kubernetes_validate.latest_version()]


def test_every_core_object_validates_against_the_kubernetes_schemas(manifests):
    _, _, docs = manifests
    kinds = {d["kind"] for d in docs}
    assert CORE_KINDS - {"StatefulSet", "PersistentVolumeClaim"} <= kinds
    assert kinds <= CORE_KINDS | {"LeaderWorkerSet"}
    for doc in docs:
        for version in schema_versions():
            if doc["kind"] == "LeaderWorkerSet":
                # Its pod templates are core PodTemplateSpecs: validate them as such.
                lwt = doc["spec"]["leaderWorkerTemplate"]
                for key in ("leaderTemplate", "workerTemplate"):
                    wrapped = {
                        "apiVersion": "v1",
                        "kind": "PodTemplate",
                        "metadata": {"name": f"{doc['metadata']['name']}-{key.lower()}"},
                        "template": lwt[key],
                    }
                    kubernetes_validate.validate(wrapped, version, strict=True)
            else:
                kubernetes_validate.validate(doc, version, strict=True)


def test_strict_validation_rejects_what_a_cluster_would(tmp_path_factory):
    _, docs = render(tmp_path_factory, [])
    workload = one(docs, "StatefulSet", "sglang-dsv4-prefill")
    version = schema_versions()[-1]
    kubernetes_validate.validate(workload, version, strict=True)
    unknown = copy.deepcopy(workload)
    unknown["spec"]["template"]["spec"]["containers"][0]["gpus"] = 4
    wrong_type = copy.deepcopy(workload)
    wrong_type["spec"]["replicas"] = "one"
    for broken in (unknown, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, version, strict=True)


# LeaderWorkerSet v1 (kubernetes-sigs/lws api/leaderworkerset/v1): the fields and values it takes.
LWS_SCHEMA = json.loads(
    (Path(sglang_dsv4.__file__).parent / "data" / "leaderworkerset-v1.schema.json").read_text()
)


def lws_errors(doc: dict) -> list[str]:
    validator = jsonschema.Draft202012Validator(LWS_SCHEMA)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_leaderworkerset_validates_against_the_schema_of_its_api(manifests):
    """Every LeaderWorkerSet against the project's schema of the LWS v1 API (v0.4.0, the
    oldest release the manifests run on): no unknown field, no wrong type; its pod templates are
    core PodTemplateSpecs, validated strictly in the core-objects test."""
    size, _, docs = manifests
    objects = find(docs, "LeaderWorkerSet")
    assert bool(objects) == (size == "across-nodes")
    for lws in objects:
        assert lws_errors(lws) == []
        assert lws["spec"]["leaderWorkerTemplate"]["size"] >= 2
        # The LeaderWorkerSet makes its own headless Service of its name: none may clash with it.
        assert not find(docs, "Service", lws["metadata"]["name"])


def test_the_leaderworkerset_schema_refuses_a_misspelled_field_and_a_wrong_type(tmp_path_factory):
    _, docs = render(tmp_path_factory, SIZES["across-nodes"])
    (lws,) = find(docs, "LeaderWorkerSet")
    misspelled = copy.deepcopy(lws)
    lwt = misspelled["spec"]["leaderWorkerTemplate"]
    lwt["restartPolicys"] = lwt.pop("restartPolicy")
    assert any("restartPolicys" in e for e in lws_errors(misspelled)), lws_errors(misspelled)
    wrong_type = copy.deepcopy(lws)
    wrong_type["spec"]["leaderWorkerTemplate"]["size"] = "2"
    assert any("size" in e and "integer" in e for e in lws_errors(wrong_type))
    wrong_value = copy.deepcopy(lws)
    wrong_value["spec"]["networkConfig"]["subdomainPolicy"] = "shared"
    assert any("subdomainPolicy" in e for e in lws_errors(wrong_value))
    nested = copy.deepcopy(lws)
    nested["spec"]["leaderWorkerTemplate"]["workerTemplate"]["specs"] = {}
    assert any("specs" in e for e in lws_errors(nested))


# --- the plan's figures where upstream's launcher reads them ------------------------------------


def test_servers_start_what_the_plan_computed(manifests, parse_server, capsys):
    size, files, docs = manifests
    for role in ("prefill", "decode"):
        p = plan_of(files, role, capsys)
        workload, pods, nnodes = groups(docs, role)
        assert (workload["kind"] == "LeaderWorkerSet") == (
            size == "across-nodes" and role == "prefill"
        )
        for pod, node_rank in pods:
            (container,) = pod["spec"]["containers"]
            gpus = container["resources"]["limits"]["nvidia.com/gpu"]
            assert gpus * nnodes == p["tp"]
            assert container["resources"]["requests"]["nvidia.com/gpu"] == gpus
            # What every LWS release injects; the node rank comes from the pod's label instead
            # (older releases inject no LWS_WORKER_INDEX).
            lws = {
                "LWS_LEADER_ADDRESS": leader_dns(docs, role, 0).rsplit(".svc.", 1)[0],
                "LWS_GROUP_SIZE": str(nnodes),
            }
            env = container_env(docs, pod, {}, node_rank)
            args = [expand(a, {**env, **lws}) for a in container["args"]]
            assert args[0] == role and "command" not in container  # the image's entrypoint
            dtype, argv = server_argv(dry_run(*args[:1], "--dry-run", *args[1:], env=env))
            server = parse_server(argv)
            assert dtype == p["index_k_dtype"]
            assert server.tp_size == p["tp"]
            assert server.mem_fraction_static == pytest.approx(p["mem_fraction_static"])
            assert server.max_running_requests == p["max_running_requests"]
            assert server.disaggregation_mode == role
            assert server.disaggregation_transfer_backend == "nixl"
            assert (server.speculative_algorithm == "EAGLE") == p["mtp"]
            assert (server.nnodes, server.node_rank) == (nnodes, node_rank)
            if nnodes > 1:
                port = next(
                    x
                    for x in pods[0][0]["spec"]["containers"][0]["ports"]
                    if x["name"] == "dist-init"
                )["containerPort"]
                assert server.dist_init_addr == f"{lws['LWS_LEADER_ADDRESS']}:{port}"
            # The figures on the pod are the plan's.
            notes = pod["metadata"]["annotations"]
            assert notes["sglang-dsv4/plan-max-running-requests"] == str(p["max_running_requests"])
            assert notes["sglang-dsv4/plan-max-total-num-tokens"] == str(p["max_total_num_tokens"])
            assert notes["sglang-dsv4/plan-kv-memory-bytes"] == str(p["kv_memory_bytes"])
            if "sessions" in p:
                assert notes["sglang-dsv4/plan-sessions-per-rank"] == str(p["sessions"]["per_rank"])
            # Where the pod mounts the model is where the server reads it.
            mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
            assert server.model_path == mounts["model"]
            assert mounts["dshm"] == "/dev/shm"
            # Ports, probes and Services meet where the server listens.
            ports = {x["name"]: x["containerPort"] for x in container["ports"]}
            assert server.port == ports["http"]
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                assert container[probe]["httpGet"]["port"] == "http"
            assert container["livenessProbe"]["httpGet"]["path"] == "/health"
            ready = container["readinessProbe"]["httpGet"]["path"]
            assert ready == ("/ready" if node_rank == 0 else "/health")
            if role == "prefill" and node_rank == 0:
                assert server.disaggregation_bootstrap_port == ports["bootstrap"]
            hicache = "--hicache" in SIZES[size] and role == "prefill"
            assert server.enable_hierarchical_cache is hicache
            if hicache:
                assert server.hicache_ratio == pytest.approx(2.0)
                assert server.hicache_write_policy == "write_back"
            host_network = pod["spec"].get("hostNetwork", False)
            assert host_network is ("--host-network" in SIZES[size])
            if host_network:
                assert pod["spec"]["dnsPolicy"] == "ClusterFirstWithHostNet"
            rdma = "--ib-device" in SIZES[size]
            assert (server.disaggregation_ib_device == "mlx5_0") is rdma
            capabilities = container["securityContext"].get("capabilities", {}).get("add", [])
            assert ("IPC_LOCK" in capabilities) is rdma


def test_the_router_reaches_every_server_by_its_pod_name(manifests, parse_server, parse_router):
    size, _, docs = manifests
    (deployment,) = find(docs, "Deployment")
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["args"] == ["router"] and "command" not in container
    assert "nvidia.com/gpu" not in container.get("resources", {}).get("limits", {})
    router = parse_router(
        router_argv(dry_run("router", "--dry-run", env=container_env(docs, pod, {})))
    )
    expected = {}
    for role in ("prefill", "decode"):
        workload, pods, _ = groups(docs, role)
        leader = pods[0][0]
        env = container_env(
            docs,
            leader,
            {"LWS_LEADER_ADDRESS": "x", "LWS_GROUP_SIZE": "1"},
        )
        server = parse_server(server_argv(dry_run(role, "--dry-run", env=env))[1])
        urls = [
            f"http://{leader_dns(docs, role, i)}:{server.port}"
            for i in range(workload["spec"]["replicas"])
        ]
        expected[role] = (urls, server.disaggregation_bootstrap_port)
    urls, bootstrap = expected["prefill"]
    assert router.prefill_urls == [(url, bootstrap) for url in urls]
    assert router.decode_urls == expected["decode"][0]
    replicas = {"prefill": 1, "decode": 1} if size == "one-node" else {"prefill": 2, "decode": 3}
    assert (len(router.prefill_urls), len(router.decode_urls)) == (
        replicas["prefill"],
        replicas["decode"],
    )
    (service,) = [
        s for s in find(docs, "Service") if s["metadata"]["name"] == deployment["metadata"]["name"]
    ]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert (
        service["spec"]["ports"][0]["port"] == router.port == container["ports"][0]["containerPort"]
    )


def test_images_and_probes_leave_margins_to_upstream_and_the_router(manifests):
    """The image of this release, pulled only when absent; a liveness probe that outwaits
    upstream's own /health timeout; a start-up probe that outlasts the router's wait for a
    server by the stated margin."""
    from sglang.srt.entrypoints import http_server
    from sglang_router.router_args import RouterArgs

    _, _, docs = manifests
    assert k8s.UPSTREAM_HEALTH_CHECK_TIMEOUT_S == http_server.HEALTH_CHECK_TIMEOUT
    assert k8s.ROUTER_WORKER_STARTUP_S == RouterArgs.worker_startup_timeout_secs
    pods = [pod for role in ("prefill", "decode") for pod, _ in groups(docs, role)[1]]
    pods.append(find(docs, "Deployment")[0]["spec"]["template"])
    for pod in pods:
        (container,) = pod["spec"]["containers"]
        assert container["image"] == f"sglang-dsv4-sm120:{sglang_dsv4.__version__}"
        assert container["imagePullPolicy"] == "IfNotPresent"
    for pod in pods[:-1]:
        (container,) = pod["spec"]["containers"]
        live, start = container["livenessProbe"], container["startupProbe"]
        assert live["timeoutSeconds"] > http_server.HEALTH_CHECK_TIMEOUT
        budget = start["periodSeconds"] * start["failureThreshold"]
        assert budget == RouterArgs.worker_startup_timeout_secs + k8s.STARTUP_MARGIN_S


def test_pods_go_where_the_operator_says_and_drains_take_one_at_a_time(manifests):
    """Servers on the selected, tainted GPU nodes with the registry and Hugging Face secrets;
    the router anywhere; replicas of a component kept apart where the cluster allows; a
    PodDisruptionBudget per component covering exactly its pods."""
    size, _, docs = manifests
    given = size == "across-nodes"
    pods = {role: [pod for pod, _ in groups(docs, role)[1]] for role in ("prefill", "decode")}
    pods["router"] = [find(docs, "Deployment")[0]["spec"]["template"]]
    budgets = {b["metadata"]["labels"]["app.kubernetes.io/component"]: b
               for b in find(docs, "PodDisruptionBudget")}
    assert budgets.keys() == pods.keys()
    for component, templates in pods.items():
        budget = budgets[component]["spec"]
        assert budget["maxUnavailable"] == 1
        for pod in templates:
            spec, labels = pod["spec"], pod["metadata"]["labels"]
            assert budget["selector"]["matchLabels"].items() <= labels.items()
            (term,) = spec["affinity"]["podAntiAffinity"][
                "preferredDuringSchedulingIgnoredDuringExecution"]
            assert term["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= labels.items()
            assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
            server = component != "router"
            assert spec.get("nodeSelector") == (
                {"nvidia.com/gpu.product": "NVIDIA-H200", "pool": "gpu"} if given and server
                else None)
            assert spec.get("tolerations") == (
                [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                 {"key": "dedicated", "operator": "Equal", "effect": "NoExecute", "value": "llm"}]
                if given and server else None)
            assert spec.get("imagePullSecrets") == ([{"name": "registry-creds"}] if given else None)
            (container,) = spec["containers"]
            token = [e for e in container.get("env", []) if e["name"] == "HF_TOKEN"]
            assert token == ([{"name": "HF_TOKEN", "valueFrom": {
                "secretKeyRef": {"name": "hf-token", "key": "token"}}}] if given and server else [])
    # Each budget selects the pods of one component only.
    assert len({tuple(sorted(b["spec"]["selector"]["matchLabels"].items()))
                for b in budgets.values()}) == 3


def test_servers_request_the_host_memory_they_use_and_a_core_per_rank(manifests, capsys):
    """Not BestEffort: a server pod requests /dev/shm (memory-backed), each rank's host memory
    and HiCache's host pool (ratio x the plan's device KV per rank), a core per rank plus two;
    no CPU or memory limit (nothing to kill a loaded server for)."""
    size, files, docs = manifests
    for role in ("prefill", "decode"):
        p = plan_of(files, role, capsys)
        for pod, _ in groups(docs, role)[1]:
            (container,) = pod["spec"]["containers"]
            resources = container["resources"]
            ranks = resources["limits"]["nvidia.com/gpu"]
            shm = next(v for v in pod["spec"]["volumes"] if v["name"] == "dshm")
            assert shm["emptyDir"]["sizeLimit"] == "32Gi"
            hicache = 2.0 * p["kv_memory_bytes"] * ranks if "--hicache" in SIZES[size] and (
                role == "prefill") else 0
            memory = 32 * 2**30 + 8 * 2**30 * ranks + hicache
            assert resources["requests"]["memory"] == f"{math.ceil(memory / 2**30)}Gi"
            assert resources["requests"]["cpu"] == str(ranks + 2)
            assert "memory" not in resources["limits"] and "cpu" not in resources["limits"]
    (router,) = find(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"]
    assert set(router["resources"]["requests"]) == {"cpu", "memory"}


def test_the_weights_claim_is_written_when_asked_and_is_what_every_server_mounts(manifests):
    size, files, docs = manifests
    claims = find(docs, "PersistentVolumeClaim")
    if size != "one-node":  # hostpath weights, no claim asked for
        assert claims == [] and "05-model.yaml" not in files
        return
    (claim,) = claims
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # read-only mounts on many nodes
    assert claim["spec"]["resources"]["requests"]["storage"] == "1Ti"
    assert claim["spec"]["storageClassName"] == "nfs-rwx"
    for role in ("prefill", "decode"):
        for pod, _ in groups(docs, role)[1]:
            (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "model"]
            claimed = volume["persistentVolumeClaim"]
            assert claimed == {"claimName": claim["metadata"]["name"], "readOnly": True}


def test_probe_paths_are_routes_upstream_serves():
    import inspect

    from sglang.srt.entrypoints.http_server import app
    from sglang.srt.utils.common import launch_dummy_health_check_server

    routes = {getattr(route, "path", None) for route in app.routes}
    assert {"/health", "/ready"} <= routes
    # A node other than an engine's first serves only the stand-in health server.
    source = inspect.getsource(launch_dummy_health_check_server)
    assert '"/health"' in source and '"/ready"' not in source


def test_router_probe_paths_are_routes_the_router_serves(tmp_path_factory):
    import importlib.util
    from pathlib import Path

    # sglang_router's server is compiled (Rust): its route table is in the library's strings.
    package = Path(importlib.util.find_spec("sglang_router").origin).parent
    (library,) = package.glob("sglang_router_rs*.so")
    strings = library.read_bytes()
    _, docs = render(tmp_path_factory, [])
    (container,) = find(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"]
    for probe in ("livenessProbe", "readinessProbe"):
        path = container[probe]["httpGet"]["path"]
        assert path.encode() in strings, path


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--tp", "6", "--gpus-per-node", "4"], ["prefill TP 6", "multiple of 4"]),
        (["--hicache-ratio", "2"], ["--hicache-ratio", "HiCache is off"]),
        (["--model-volume", "nfs:/x"], ["--model-volume", "pvc:NAME"]),
        (["--ib-device", "mlx5_0:1"], ["--ib-device", "without a port"]),
        (["--ib-device", "mlx5_0"], ["--ib-device mlx5_0", "no RDMA device", "--rdma-resource"]),
        (["--rdma-resource", "rdma=one"], ["--rdma-resource", "NAME=COUNT"]),
        (["--namespace", "LLM"], ["--namespace", "DNS label"]),
        (["--index-k-dtype", "int4"], ["'int4' is not supported"]),
        (["--gpu", "toaster"], ["--gpu 'toaster'", "unknown GPU"]),
        (["--shm-size", "32 gigs"], ["--shm-size", "quantity"]),
        (["--context", "0"], ["--context 0", "at least 1"]),
        (["--node-selector", "gpu"], ["--node-selector 'gpu'", "LABEL=VALUE"]),
        (["--toleration", "gpu:Sometimes"], ["--toleration 'gpu:Sometimes'", "NoSchedule"]),
        (["--hf-token-secret", "HF_Token"], ["--hf-token-secret 'HF_Token'", "Secret"]),
        (["--create-pvc", "1 TB"], ["--create-pvc '1 TB'", "quantity"]),
        (["--model-volume", "none", "--create-pvc", "1Ti"], ["--create-pvc", "pvc:NAME"]),
        (["--storage-class", "nfs"], ["--storage-class", "--create-pvc"]),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, args, words):
    out = tmp_path / "out"
    assert main(["k8s", "--out", str(out), *args]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1, captured.err
    assert lines[0].startswith("sglang-dsv4 k8s: ")
    for word in words:
        assert word in lines[0], lines[0]
    assert not out.exists()


def test_rendering_again_into_default_drops_only_its_own_namespace_file(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["k8s", "--out", str(out), "--namespace", "llm"]) == 0
    assert one(yaml.safe_load_all((out / "00-namespace.yaml").read_text()), "Namespace", "llm")
    (out / "kustomization.yaml").write_text("resources: []\n")  # the operator's own file
    assert main(["k8s", "--out", str(out), "--namespace", "default"]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["10-prefill.yaml", "20-decode.yaml", "30-router.yaml", "kustomization.yaml"]
    docs = [d for p in out.glob("[0-9]*.yaml") for d in yaml.safe_load_all(p.read_text()) if d]
    assert {d["metadata"]["namespace"] for d in docs} == {"default"}
    # So does the claim it wrote, once --create-pvc is left out.
    assert main(["k8s", "--out", str(out), "--namespace", "default", "--create-pvc", "1Ti"]) == 0
    assert (out / "05-model.yaml").exists()
    assert main(["k8s", "--out", str(out), "--namespace", "default"]) == 0
    assert not (out / "05-model.yaml").exists()
    # A file of that name the command did not write stays.
    (out / "00-namespace.yaml").write_text("apiVersion: v1\nkind: Namespace\n")
    assert main(["k8s", "--out", str(out), "--namespace", "default"]) == 0
    assert (out / "00-namespace.yaml").exists()
    capsys.readouterr()


# --- docker/README.md: the cluster commands it shows ---------------------------------------------


def test_the_cluster_commands_in_the_readme_render_and_are_applied(tmp_path, capsys):
    commands = test_docker.shell_commands(test_docker.readme_section("A cluster (Kubernetes)"))
    renders = [w for w in commands if w[:2] == ["sglang-dsv4", "k8s"]]
    applied = [w[-1] for w in commands if w[:3] == ["kubectl", "apply", "-f"]]
    assert len(renders) == 2 and len(applied) == len(renders)
    kinds = []
    for words in renders:
        out = words[words.index("--out") + 1]
        assert out in applied  # each rendered folder is the one applied
        local = [*words[2:]]
        local[local.index("--out") + 1] = str(tmp_path / out)
        assert main(["k8s", *local]) == 0
        docs = [
            d for p in (tmp_path / out).glob("*.yaml") for d in yaml.safe_load_all(p.read_text())
        ]
        kinds.append({d["kind"] for d in docs if d})
    # One of each shape: an engine on one node, and one spanning nodes.
    assert "StatefulSet" in kinds[0] and "LeaderWorkerSet" not in kinds[0]
    assert "LeaderWorkerSet" in kinds[1]
    capsys.readouterr()
