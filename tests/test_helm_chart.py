"""The Helm chart: lint, render, and validate every object against the Kubernetes JSON schemas
of two Kubernetes versions, for each values file in helm/ci/; invalid values must fail."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "splitfire"
VALUES = sorted((ROOT / "helm" / "ci").glob("*.yaml"))
INVALID = sorted((ROOT / "helm" / "ci" / "invalid").glob("*.yaml"))
K8S_VERSIONS = ("1.29.0", "1.33.0")
# Capabilities a production cluster has: the Prometheus Operator and Gateway API CRDs.
API_VERSIONS = ["monitoring.coreos.com/v1/ServiceMonitor", "gateway.networking.k8s.io/v1/HTTPRoute"]
# CRD kinds have no schema in the Kubernetes OpenAPI; they get a structural check instead.
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor"): ("endpoints", "selector"),
        ("gateway.networking.k8s.io/v1", "HTTPRoute"): ("parentRefs", "rules")}


@pytest.fixture(scope="module")
def helm() -> str:
    sys.path.insert(0, str(ROOT / "helm" / "tools"))
    from install_helm import install

    return str(install(ROOT / ".tools" / "helm"))


def render(helm: str, values: Path, *extra: str) -> subprocess.CompletedProcess:
    args = [helm, "template", "rel", str(CHART), "-f", str(values), "--namespace", "llm"]
    for a in API_VERSIONS:
        args += ["--api-versions", a]
    return subprocess.run([*args, *extra], capture_output=True, text=True)


@pytest.mark.parametrize("values", VALUES, ids=[v.stem for v in VALUES])
def test_chart_lints_renders_and_validates(helm, values):
    import kubernetes_validate

    lint = subprocess.run([helm, "lint", "--strict", str(CHART), "-f", str(values)], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    out = render(helm, values)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap"} <= kinds
    sm = ((yaml.safe_load(values.read_text()) or {}).get("metrics", {}).get("serviceMonitor", {}))
    assert ("ServiceMonitor" in kinds) == sm.get("enabled", True)  # the CRD is "installed" via --api-versions
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        if key in CRDS:
            assert all(f in doc["spec"] for f in CRDS[key]), doc
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError as e:  # the CLI only warns; we fail
                pytest.fail(f"no schema for {key} in Kubernetes {version}: {e}")
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} invalid for Kubernetes {version}: {e.message} "
                            f"at {list(e.path)}")


def test_workers_get_gpus_rdma_and_drain_time(helm):
    docs = [d for d in yaml.safe_load_all(render(helm, ROOT / "helm/ci/gpu-8decode-4prefill-rdma-values.yaml").stdout) if d]
    deps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    decode, prefill = deps["rel-splitfire-decode"], deps["rel-splitfire-prefill"]
    assert decode["spec"]["replicas"] == 8 and prefill["spec"]["replicas"] == 4
    for dep in (decode, prefill):
        pod = dep["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert c["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
        assert "--mooncake-protocol=rdma" in c["args"]
        assert pod["terminationGracePeriodSeconds"] > 30
    router = deps["rel-splitfire-router"]["spec"]["template"]["spec"]["containers"][0]
    assert "prefill=rel-splitfire-prefill.llm.svc.cluster.local:50061" in router["args"]
    assert any(e["name"] == "REDIS_URL" for e in router["env"])


def test_cpu_values_request_no_gpus(helm):
    docs = [d for d in yaml.safe_load_all(render(helm, ROOT / "helm/ci/cpu-tiny-values.yaml").stdout) if d]
    for d in docs:
        if d["kind"] == "Deployment":
            for c in d["spec"]["template"]["spec"]["containers"]:
                assert "nvidia.com/gpu" not in c["resources"].get("limits", {})


def test_helm_test_pod_needs_no_image_beyond_the_release(helm, tmp_path):
    """`helm test` runs on the router image unless `tests.image` names another (an air-gapped cluster
    has only the release's images: the curl image it used could not be pulled on the test node)."""
    def test_pod(*extra: str) -> dict:
        out = render(helm, ROOT / "helm/ci/cpu-tiny-values.yaml", *extra)
        assert out.returncode == 0, out.stderr
        return next(d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "Pod")

    pod = test_pod("--set", "image.router=localhost/splitfire-router,image.tag=9.9")
    c = pod["spec"]["containers"][0]
    assert c["image"] == "localhost/splitfire-router:9.9"
    assert c["command"] == ["python3", "-c"]
    compile(c["args"][0], "test-chat", "exec")  # the check is valid Python
    assert test_pod("--set", "tests.image=python:3.12-slim")["spec"]["containers"][0]["image"] == "python:3.12-slim"


@pytest.mark.parametrize("values", INVALID, ids=[v.stem for v in INVALID])
def test_invalid_values_fail_at_template_time(helm, values):
    out = render(helm, values)
    assert out.returncode != 0
    assert "schema" in out.stderr


def test_workers_share_one_kv_store_master(helm):
    docs = [d for d in yaml.safe_load_all(render(helm, ROOT / "helm/ci/default-values.yaml").stdout) if d]
    deps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    master = deps["rel-splitfire-kv-store"]["spec"]["template"]["spec"]["containers"][0]
    assert master["command"] == ["mooncake_master"] and "-rpc_port=50055" in master["args"]
    assert master["readinessProbe"]["tcpSocket"]["port"] == "rpc"
    services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    assert "rel-splitfire-kv-store" in services
    assert "--shared-kv-store" in deps["rel-splitfire-router"]["spec"]["template"]["spec"]["containers"][0]["args"]
    for role in ("decode", "prefill"):
        args = deps[f"rel-splitfire-{role}"]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--kv-store=rel-splitfire-kv-store:50055" in args and "--kv-store-gb=4" in args
    off = [d for d in yaml.safe_load_all(render(helm, ROOT / "helm/ci/default-values.yaml",
                                                "--set", "kvStore.enabled=false").stdout) if d]
    assert not any(d["metadata"]["name"].endswith("kv-store") for d in off)
    assert not any(a.startswith("--kv-store") for d in off if d["kind"] == "Deployment"
                   for a in d["spec"]["template"]["spec"]["containers"][0].get("args", []))


def test_routers_may_reach_the_decode_workers_token_stream_port(helm):
    """The router reads decode workers' tokens over their HTTP (metrics) port: the workers'
    NetworkPolicy must let routers in there, not only the monitoring namespaces."""
    docs = [d for d in yaml.safe_load_all(render(helm, ROOT / "helm/ci/default-values.yaml",
                                                 "--set", "networkPolicy.enabled=true").stdout) if d]
    policy = next(d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-workers"))
    deps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    decode_args = deps["rel-splitfire-decode"]["spec"]["template"]["spec"]["containers"][0]["args"]
    port = int(next(a for a in decode_args if a.startswith("--metrics-port=")).split("=")[1])
    from_router = [rule for rule in policy["spec"]["ingress"]
                   if any(p.get("podSelector", {}).get("matchLabels", {}).get("splitfire.io/router") == "true"
                          for p in rule["from"])]
    assert any(p["port"] == port for rule in from_router for p in rule["ports"]), from_router


def test_tensor_parallel_workers_get_one_gpu_per_rank(helm):
    tp = ["--set", "workers.tensorParallelSize=8", "--set", "prefill.gpus=8", "--set", "decode.gpus=8",
          "--set", "kvStore.enabled=false"]
    out = render(helm, ROOT / "helm/ci/gpu-8decode-4prefill-rdma-values.yaml", *tp)
    assert out.returncode == 0, out.stderr
    deps = {d["metadata"]["name"]: d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "Deployment"}
    for role in ("prefill", "decode"):
        c = deps[f"rel-splitfire-{role}"]["spec"]["template"]["spec"]["containers"][0]
        assert "--tensor-parallel-size=8" in c["args"] and c["resources"]["limits"]["nvidia.com/gpu"] == 8
    # The KV store with split KV: every rank publishes and fetches its own part (worker/kv/tier_ranks.py).
    kv = render(helm, ROOT / "helm/ci/gpu-8decode-4prefill-rdma-values.yaml", *tp[:6])
    assert kv.returncode == 0, kv.stderr
    kv_deps = {d["metadata"]["name"]: d for d in yaml.safe_load_all(kv.stdout) if d and d["kind"] == "Deployment"}
    for role in ("prefill", "decode"):
        args = kv_deps[f"rel-splitfire-{role}"]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--tensor-parallel-size=8" in args and any(a.startswith("--kv-store=") for a in args)
    # Refused at template time, by name: fewer GPUs than ranks.
    gpus = render(helm, ROOT / "helm/ci/gpu-8decode-4prefill-rdma-values.yaml", *tp[:4], *tp[6:])
    assert gpus.returncode != 0 and "one GPU per rank" in gpus.stderr
    # Each role split its own way (prefill ranks write head slices into the decode ranks).
    split = render(helm, ROOT / "helm/ci/gpu-8decode-4prefill-rdma-values.yaml", *tp,
                   "--set", "prefill.tensorParallelSize=4", "--set", "prefill.gpus=4")
    assert split.returncode == 0, split.stderr
    deps = {d["metadata"]["name"]: d for d in yaml.safe_load_all(split.stdout) if d and d["kind"] == "Deployment"}
    pre = deps["rel-splitfire-prefill"]["spec"]["template"]["spec"]["containers"][0]
    dec = deps["rel-splitfire-decode"]["spec"]["template"]["spec"]["containers"][0]
    assert "--tensor-parallel-size=4" in pre["args"] and pre["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert "--tensor-parallel-size=8" in dec["args"]
    short = render(helm, ROOT / "helm/ci/gpu-8decode-4prefill-rdma-values.yaml", *tp,
                   "--set", "prefill.tensorParallelSize=4")
    assert short.returncode != 0 and "prefill.gpus must equal its tensor-parallel size 4" in short.stderr


def test_lora_adapters_reach_every_worker_as_flags_the_cli_accepts(helm):
    lora = ["--set", "workers.lora.modules.support=/models/adapters/support", "--set",
            "workers.lora.modules.sql=/models/adapters/sql", "--set", "workers.lora.root=/models/adapters"]
    out = render(helm, ROOT / "helm/ci/default-values.yaml", *lora)
    assert out.returncode == 0, out.stderr
    deps = {d["metadata"]["name"]: d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "Deployment"}
    from splitfire_cli import build_parser
    from worker.config import engine_config_from

    for role in ("prefill", "decode"):
        args = deps[f"rel-splitfire-{role}"]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--lora-root=/models/adapters" in args
        ns = build_parser().parse_args(args)  # the worker's own parser takes what the chart renders
        cfg = engine_config_from(ns)
        assert cfg.lora_modules == {"support": "/models/adapters/support", "sql": "/models/adapters/sql"}
        assert (cfg.max_loras, cfg.max_lora_rank, cfg.lora_dtype) == (4, 16, "float32")
    off = render(helm, ROOT / "helm/ci/default-values.yaml")
    assert "--lora-modules" not in off.stdout and "--enable-lora" not in off.stdout
    bad = render(helm, ROOT / "helm/ci/default-values.yaml", "--set", "workers.lora.maxLoras=0")
    assert bad.returncode != 0 and "schema" in bad.stderr


def test_planner_gets_exactly_the_scale_of_the_worker_deployments_and_args_its_cli_accepts(helm, tmp_path):
    """`planner.enabled`: a Deployment running `splitfire planner run --scale-deployments`, its profile in a
    ConfigMap, and a Role that may get and patch only the prefill and decode Deployments' scale."""
    values = tmp_path / "planner.yaml"
    values.write_text(yaml.safe_dump({"planner": {"enabled": True, "maxDecode": 6,
                                                  "profile": {"prefill_tps": 9000, "decode_itl": {"1": 0.01}}}}))
    out = render(helm, ROOT / "helm/ci/default-values.yaml", "-f", str(values))
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    role = by[("Role", "rel-splitfire-planner")]
    assert role["rules"] == [{"apiGroups": ["apps"], "resources": ["deployments/scale"],
                              "resourceNames": ["rel-splitfire-prefill", "rel-splitfire-decode"],
                              "verbs": ["get", "patch"]}]
    assert ("Deployment", "rel-splitfire-prefill") in by and ("Deployment", "rel-splitfire-decode") in by
    binding = by[("RoleBinding", "rel-splitfire-planner")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rel-splitfire-planner", "namespace": "llm"}]
    pod = by[("Deployment", "rel-splitfire-planner")]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "rel-splitfire-planner"
    args = pod["containers"][0]["args"]
    from splitfire_cli import build_parser

    ns = build_parser().parse_args(args)  # the planner's own parser takes what the chart renders
    assert ns.scale_deployments == "rel-splitfire-prefill,rel-splitfire-decode" and ns.max_decode == 6
    assert ns.router == "http://rel-splitfire-router:8000" and ns.namespace == "llm"
    # what it learns is kept on the state volume (an emptyDir unless planner.stateClaim names a claim)
    mount = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}["state"]
    assert ns.state == mount + "/state.json"
    assert {v["name"]: v for v in pod["volumes"]}["state"] == {"name": "state", "emptyDir": {}}
    claimed = render(helm, ROOT / "helm/ci/default-values.yaml", "-f", str(values), "--set",
                     "planner.stateClaim=planner-state")
    pod2 = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(claimed.stdout)
            if d}[("Deployment", "rel-splitfire-planner")]["spec"]["template"]["spec"]
    assert {v["name"]: v for v in pod2["volumes"]}["state"]["persistentVolumeClaim"] == {"claimName": "planner-state"}
    import json

    profile = json.loads(by[("ConfigMap", "rel-splitfire-planner")]["data"]["profile.json"])
    assert profile == {"prefill_tps": 9000, "decode_itl": {"1": 0.01}}
    off = render(helm, ROOT / "helm/ci/default-values.yaml")
    assert "planner" not in {d["metadata"]["name"].rsplit("-", 1)[-1] for d in yaml.safe_load_all(off.stdout) if d}
    bad = render(helm, ROOT / "helm/ci/default-values.yaml", "--set", "planner.enabled=true")
    assert bad.returncode != 0 and "planner.profile" in bad.stderr


def test_model_pools_get_their_own_workers_and_the_router_serves_every_pool(helm, tmp_path):
    """`modelPools`: each pool's prefill and decode Deployments and headless Services, its model in their env
    (and fetched by their init container), its values merged over the top-level ones; no selector of one
    pool's objects matches another's pods; the router discovers every pool and serves each under its
    name, with flags its own parser accepts."""
    values = tmp_path / "pools.yaml"
    values.write_text(yaml.safe_dump({"modelPools": [
        {"name": "qwen", "model": "/models/Qwen3-4B", "decode": {"replicas": 2}},
        {"name": "mistral", "model": "/models/Mistral-7B", "servedName": "mistral-7b", "prefill": {"gpus": 2},
         "decode": {"tensorParallelSize": 2, "gpus": 2}},
    ], "kvStore": {"enabled": False}}))  # (a split pool: no cluster KV store yet)
    out = render(helm, ROOT / "helm/ci/default-values.yaml", "-f", str(values))
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    deps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    svcs = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    workers = {f"rel-splitfire-{p}{r}" for p in ("", "qwen-", "mistral-") for r in ("prefill", "decode")}
    assert workers <= set(deps) and workers <= set(svcs)

    def container(name: str) -> dict:
        return deps[name]["spec"]["template"]["spec"]["containers"][0]

    def env(name: str) -> dict:
        return {e["name"]: e.get("value") for e in container(name)["env"]}

    assert env("rel-splitfire-qwen-decode")["SPLITFIRE_MODEL"] == "/models/Qwen3-4B"
    assert env("rel-splitfire-decode")["SPLITFIRE_MODEL"] == "smollm2-135m-instruct"
    assert deps["rel-splitfire-qwen-decode"]["spec"]["replicas"] == 2
    assert deps["rel-splitfire-qwen-prefill"]["spec"]["replicas"] == deps["rel-splitfire-prefill"]["spec"]["replicas"]
    assert container("rel-splitfire-qwen-prefill")["resources"] == container("rel-splitfire-prefill")["resources"]
    assert "--tensor-parallel-size=2" in container("rel-splitfire-mistral-decode")["args"]
    assert "--tensor-parallel-size=2" not in container("rel-splitfire-mistral-prefill")["args"]
    # No object of one pool selects another pool's pods.
    for name, d in deps.items():
        if name not in workers:
            continue
        sel = d["spec"]["selector"]["matchLabels"]
        assert sel == svcs[name]["spec"]["selector"]
        for other in workers - {name}:
            labels = deps[other]["spec"]["template"]["metadata"]["labels"]
            assert not sel.items() <= labels.items(), (name, other)
    # The router: every pool discovered, each model served under its name; its own parser takes the flags.
    router = container("rel-splitfire-router")
    args = router["args"]
    assert "--extra-model=qwen=/models/Qwen3-4B" in args and "--extra-model=mistral-7b=/models/Mistral-7B" in args
    assert "decode=rel-splitfire-qwen-decode.llm.svc.cluster.local:50051" in args
    assert "prefill=rel-splitfire-mistral-prefill.llm.svc.cluster.local:50061" in args
    from splitfire_cli import build_parser

    ns = build_parser().parse_args(args)  # `router ...`: the CLI's own parser
    assert len(ns.discover_dns) == 6 and len(ns.extra_model) == 2
    inits = deps["rel-splitfire-router"]["spec"]["template"]["spec"].get("initContainers", [])
    if inits:  # model.source=fetch: the router reads every model's tokenizer
        assert sorted(e["value"] for i in inits for e in i["env"] if e["name"] == "SPLITFIRE_MODEL") == sorted(
            ["smollm2-135m-instruct", "/models/Qwen3-4B", "/models/Mistral-7B"])
    # Refused by name: a pool named twice, or after another component; a name that is not a DNS label.
    twice = render(helm, ROOT / "helm/ci/default-values.yaml", "-f", str(values),
                   "--set", "modelPools[1].name=qwen")
    assert twice.returncode != 0 and 'name "qwen" is used twice' in twice.stderr
    bad = render(helm, ROOT / "helm/ci/default-values.yaml", "-f", str(values), "--set", "modelPools[0].name=Qwen_3")
    assert bad.returncode != 0 and "schema" in bad.stderr


def test_pipeline_stages_reach_the_workers_on_cpu_and_are_refused_on_gpus(helm):
    """`workers.pipelineParallelSize` (and each role's own): the worker's own parser takes what the chart
    renders; stages run on CPU hosts only, so GPU workers with stages fail at template time, by name."""
    from splitfire_cli import build_parser
    from worker.config import engine_config_from

    out = render(helm, ROOT / "helm/ci/cpu-tiny-values.yaml", "--set", "workers.pipelineParallelSize=2",
                 "--set", "decode.pipelineParallelSize=3")
    assert out.returncode == 0, out.stderr
    deps = {d["metadata"]["name"]: d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "Deployment"}
    for role, stages in (("prefill", 2), ("decode", 3)):
        args = deps[f"rel-splitfire-{role}"]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert f"--pipeline-parallel-size={stages}" in args
        assert engine_config_from(build_parser().parse_args(args)).pipeline_parallel_size == stages
    plain = render(helm, ROOT / "helm/ci/cpu-tiny-values.yaml")
    assert plain.returncode == 0 and "--pipeline-parallel-size" not in plain.stdout
    gpu = render(helm, ROOT / "helm/ci/default-values.yaml", "--set", "prefill.pipelineParallelSize=2")
    assert gpu.returncode != 0 and "prefill: pipelineParallelSize 2 needs workers.device=cpu" in gpu.stderr
    bad = render(helm, ROOT / "helm/ci/cpu-tiny-values.yaml", "--set", "workers.pipelineParallelSize=0")
    assert bad.returncode != 0 and "schema" in bad.stderr


def test_tracing_endpoint_reaches_every_router_and_worker_as_otel_variables(helm):
    def env_of(*extra: str) -> dict[str, dict[str, str]]:
        out = render(helm, ROOT / "helm/ci/default-values.yaml", *extra)
        assert out.returncode == 0, out.stderr
        docs = [d for d in yaml.safe_load_all(out.stdout) if d]
        return {d["metadata"]["name"]: {e["name"]: e.get("value") for e in d["spec"]["template"]["spec"]
                                        ["containers"][0].get("env", [])}
                for d in docs if d["kind"] == "Deployment" and not d["metadata"]["name"].endswith(("kv-store", "redis"))}

    off = env_of()
    assert off and not any(k.startswith("OTEL_") for env in off.values() for k in env)
    on = env_of("--set", "tracing.otlpEndpoint=http://otel-collector.obs:4317", "--set", "tracing.samplerArg=0.25")
    for name in ("rel-splitfire-router", "rel-splitfire-decode", "rel-splitfire-prefill"):
        env = on[name]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.obs:4317", name
        assert env["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio" and env["OTEL_TRACES_SAMPLER_ARG"] == "0.25"
        assert env["OTEL_EXPORTER_OTLP_INSECURE"] == "true" and env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/protobuf"
    grpc = env_of("--set", "tracing.otlpEndpoint=http://otel-collector.obs:4317", "--set", "tracing.protocol=grpc")
    assert grpc["rel-splitfire-router"]["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
    bad = render(helm, ROOT / "helm/ci/default-values.yaml", "--set", "tracing.protocol=http/json")
    assert bad.returncode != 0 and "protocol" in bad.stderr


def test_routers_share_a_files_volume_when_one_is_named(helm):
    def router_pod(*extra: str) -> dict:
        out = render(helm, ROOT / "helm/ci/default-values.yaml", *extra)
        assert out.returncode == 0, out.stderr
        docs = [d for d in yaml.safe_load_all(out.stdout) if d]
        return next(d for d in docs if d["kind"] == "Deployment"
                    and d["metadata"]["name"] == "rel-splitfire-router")["spec"]["template"]["spec"]

    pod = router_pod()
    c = pod["containers"][0]
    assert "--files-dir=/var/lib/splitfire/files" in c["args"]
    assert {"name": "files", "mountPath": "/var/lib/splitfire/files"} in c["volumeMounts"]
    assert next(v for v in pod["volumes"] if v["name"] == "files") == {"name": "files", "emptyDir": {"sizeLimit": "10Gi"}}
    shared = router_pod("--set", "router.filesClaim=batch-files")
    assert next(v for v in shared["volumes"] if v["name"] == "files") == {
        "name": "files", "persistentVolumeClaim": {"claimName": "batch-files"}}
