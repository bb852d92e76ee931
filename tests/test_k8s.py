"""`make test-k8s` (opt-in: SPLITFIRE_TEST_K8S=1): the chart on a real Kubernetes 1.20 on this machine
(helm/tools/kube_cluster.py: etcd, kube-apiserver, controller-manager and scheduler built from Debian's
source; helm/tools/kube_node.py: one node - kubelet, containerd with runc, kube-proxy, CNI bridge, cluster
DNS). Two tests, printing each step:

1. control plane only: every object the chart renders is accepted (RBAC, NetworkPolicy, the planner's
   Role), the Deployments get Pods (Pending: no node yet), the planner's service account scales exactly
   the worker Deployments through the scale subresource and nothing else, install / upgrade / rollback /
   uninstall leave nothing behind;
2. with the node: `make image`'s images loaded, the chart installed with SmolLM2 on a hostPath volume,
   every pod Ready through the chart's own probes, a streamed chat (the official OpenAI client) through
   the router's Service, the workers publishing KV blocks to the KV-store pod, Redis holding keys, `helm
   test`, `helm upgrade` to 2 decode pods and the router placing on both, a
   decode pod killed and streams still served, `helm rollback`, the planner pod (`planner.enabled`) adding a
   decode pod under a load step through the router and draining it when the load falls with no request failed,
   `helm uninstall` leaving no object and no container.

Not proven here: GPUs (device plugin resources), RDMA, more than one node, NetworkPolicy enforcement (the
bridge CNI does not enforce policies; the API server accepts them), Redis's own image (Debian's
redis-server on `make image`'s base stands in: no registry here)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(os.environ.get("SPLITFIRE_TEST_K8S") != "1",
                                reason="opt-in: make test-k8s (builds Kubernetes from Debian's source once)")
sys.path.insert(0, str(ROOT / "helm" / "tools"))

NS = "llm"
REL = "rel"
FULL = f"{REL}-splitfire"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from kube_cluster import ControlPlane

    with ControlPlane(tmp_path_factory.mktemp("k8s")) as cp:
        print("control plane ready", flush=True)
        yield cp


@pytest.fixture(scope="module")
def helm() -> str:
    from install_helm import install

    return str(install(ROOT / ".tools" / "helm"))


def run(cp, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, env=cp.env())


def objects(cp, kinds: str) -> list[dict]:
    r = cp.kubectl("get", kinds, "-n", NS, "-l", f"app.kubernetes.io/instance={REL}", "-o", "json")
    return json.loads(r.stdout)["items"]


def wait(cond, timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def chart_for_1_20(tmp: Path) -> tuple[Path, list[str]]:
    """The API server built here is Kubernetes 1.20 (Debian's source); the chart asks for >= 1.27. A copy
    with that floor lowered, and the two objects that need newer APIs off (policy/v1 PodDisruptionBudgets:
    1.21; autoscaling/v2 HPA: 1.23, already off in the CPU values); everything else installs as shipped,
    sent without helm's client-side schema check: 1.20's schema lacks NetworkPolicyPort.endPort (1.22+; the
    Mooncake port range), which this server drops."""
    import shutil

    chart = tmp / "splitfire"
    shutil.copytree(ROOT / "helm" / "splitfire", chart)
    meta = (chart / "Chart.yaml").read_text()
    assert 'kubeVersion: ">=1.27.0-0"' in meta
    (chart / "Chart.yaml").write_text(meta.replace('kubeVersion: ">=1.27.0-0"', 'kubeVersion: ">=1.20.0-0"'))
    return chart, ["-f", str(ROOT / "helm" / "ci" / "cpu-tiny-values.yaml"), "--set", "podDisruptionBudget.enabled=false",
                   "--disable-openapi-validation"]


def test_chart_installs_scales_upgrades_rolls_back_and_uninstalls(cluster, helm, tmp_path):
    """(Runs before the node starts: its pods must stay Pending.)"""
    cp = cluster
    chart, values = chart_for_1_20(tmp_path)
    r = run(cp, helm, "install", REL, str(chart), "-n", NS, "--create-namespace", *values)
    assert r.returncode == 0, r.stderr
    print("helm install: deployed", flush=True)
    deps = {d["metadata"]["name"]: d for d in objects(cp, "deployments")}
    assert {f"{FULL}-router", f"{FULL}-prefill", f"{FULL}-decode", f"{FULL}-planner"} <= set(deps)
    kinds = {o["kind"] for o in objects(cp, "serviceaccounts,roles,rolebindings,networkpolicies,services,configmaps")}
    assert {"ServiceAccount", "Role", "RoleBinding", "NetworkPolicy", "Service", "ConfigMap"} <= kinds
    # The controller-manager made each Deployment's ReplicaSet and Pods; with no node they wait, Pending.
    wait(lambda: len(objects(cp, "pods")) >= len(deps), what="the Deployments' pods")
    assert all(p["status"]["phase"] == "Pending" for p in objects(cp, "pods"))
    print(f"{len(objects(cp, 'pods'))} pods created (Pending: no kubelet here)", flush=True)

    # The planner's own service account scales the worker Deployments, and nothing else.
    from planner.kubernetes import DeploymentScaler, KubeAPI

    token = ""
    def sa_token() -> bool:
        nonlocal token
        for s in json.loads(cp.kubectl("get", "secrets", "-n", NS, "-o", "json").stdout)["items"]:
            if s["type"] == "kubernetes.io/service-account-token" and \
                    s["metadata"]["annotations"].get("kubernetes.io/service-account.name") == f"{FULL}-planner":
                token = base64.b64decode(s["data"]["token"]).decode()
                return True
        return False

    wait(sa_token, what="the planner service account's token")
    server = f"https://127.0.0.1:{cp.api_port}"
    api = KubeAPI(server, ssl.create_default_context(cafile=str(cp.dir / "pki" / "ca.crt")), token)
    scaler = DeploymentScaler(api, NS, {"prefill": f"{FULL}-prefill", "decode": f"{FULL}-decode"})

    async def scale() -> None:
        import aiohttp

        async with aiohttp.ClientSession() as s:
            assert await scaler.replicas(s, "decode") == 1
            await scaler.scale(s, "decode", 3)
            assert await scaler.replicas(s, "decode") == 3
            router = DeploymentScaler(api, NS, {"prefill": f"{FULL}-router", "decode": f"{FULL}-router"})
            with pytest.raises(PermissionError):
                await router.scale(s, "decode", 5)

    asyncio.run(scale())
    wait(lambda: sum(1 for p in objects(cp, "pods") if "decode" in p["metadata"]["name"]) == 3,
         what="three decode pods after the planner's scale")
    print("planner scaled decode 1 -> 3 through the scale subresource; 403 on the router", flush=True)

    r = run(cp, helm, "upgrade", REL, str(chart), "-n", NS, *values, "--set", "decode.replicas=2")
    assert r.returncode == 0, r.stderr
    assert cp.kubectl("get", "deployment", f"{FULL}-decode", "-n", NS, "-o",
                      "jsonpath={.spec.replicas}").stdout == "2"
    r = run(cp, helm, "rollback", REL, "1", "-n", NS)
    assert r.returncode == 0, r.stderr
    assert cp.kubectl("get", "deployment", f"{FULL}-decode", "-n", NS, "-o",
                      "jsonpath={.spec.replicas}").stdout == "1"
    print("helm upgrade (decode 2) and rollback (decode 1): ok", flush=True)
    r = run(cp, helm, "uninstall", REL, "-n", NS)
    assert r.returncode == 0, r.stderr
    wait(lambda: not objects(cp, "all,configmaps,serviceaccounts,roles,rolebindings,networkpolicies"),
         what="nothing of the release left")
    print("helm uninstall: nothing left", flush=True)


# -- with a node --------------------------------------------------------------------------------------

VERSION = "0.1.0"
IMAGES = (f"localhost/splitfire-worker:{VERSION}", f"localhost/splitfire-router:{VERSION}")
REDIS_IMAGE = "localhost/splitfire-test-redis:bookworm"


def build_redis_image() -> None:
    """The chart's Redis from Debian's redis-server on `make image`'s base (no registry here to pull
    redis:7.4-alpine from; the chart's args and probes are the official image's: redis-server
    arguments, redis-cli)."""
    if subprocess.run(["podman", "image", "exists", REDIS_IMAGE]).returncode == 0:
        return
    bases = subprocess.run(["podman", "images", "--format", "{{.Repository}}:{{.Tag}}", "--filter",
                            "reference=localhost/splitfire-base"], capture_output=True, text=True).stdout.split()
    if not bases:
        pytest.fail("no localhost/splitfire-base image: run `make image` first")
    import tempfile

    with tempfile.TemporaryDirectory() as ctx:
        Path(ctx, "Containerfile").write_text(
            f"FROM {sorted(bases)[-1]}\n"
            "RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "
            "redis-server && rm -rf /var/lib/apt/lists/* && mkdir -p /data\n"
            "WORKDIR /data\nENTRYPOINT [\"redis-server\"]\n")
        r = subprocess.run(["podman", "build", "-q", "-t", REDIS_IMAGE, ctx], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]


@pytest.fixture(scope="module")
def node(cluster, tmp_path_factory):
    from kube_node import Node

    missing = [i for i in IMAGES if subprocess.run(["podman", "image", "exists", i]).returncode != 0]
    if missing:
        pytest.fail(f"{', '.join(missing)} not built: run `make image` first")
    build_redis_image()
    t0 = time.monotonic()
    with Node(cluster, tmp_path_factory.mktemp("node")) as n:
        print(f"node Ready in {time.monotonic() - t0:.0f} s", flush=True)
        for image in (*IMAGES, REDIS_IMAGE):
            took = n.load_image(image)
            print(f"{image}: " + (f"imported in {took:.0f} s" if took else "already in containerd"), flush=True)
        yield n


def pods_ready(cp, component: str | None = None) -> list[dict]:
    ready = []
    for p in objects(cp, "pods"):
        if component and p["metadata"]["labels"].get("app.kubernetes.io/component") != component:
            continue
        if p["metadata"].get("deletionTimestamp"):
            continue
        conds = {c["type"]: c["status"] for c in p["status"].get("conditions") or []}
        if conds.get("Ready") == "True":
            ready.append(p)
    return ready


def wait_ready(cp, node, want: dict[str, int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        crashed = [(p["metadata"]["name"], c["name"]) for p in objects(cp, "pods")
                   for c in p["status"].get("containerStatuses") or [] if c.get("restartCount", 0) >= 2]
        if crashed:
            pod, container = crashed[0]
            log = cp.kubectl("logs", "-n", NS, pod, "-c", container, "--previous", "--tail=40", check=False).stdout
            raise AssertionError(f"{pod}/{container} keeps restarting; its last run:\n{log}")
        if all(len(pods_ready(cp, c)) == n for c, n in want.items()) and \
                all(not p["metadata"].get("deletionTimestamp") for p in objects(cp, "pods")):
            return
        time.sleep(1)
    state = "\n".join(f"{p['metadata']['name']}: {p['status'].get('phase')} "
                      f"{[c.get('state') for c in p['status'].get('containerStatuses') or []]}"
                      for p in objects(cp, "pods"))
    logs = "\n".join(cp.kubectl("logs", "-n", NS, p["metadata"]["name"], "--all-containers", "--tail=30",
                                check=False).stdout for p in objects(cp, "pods"))
    raise AssertionError(f"pods not Ready {want} after {timeout:.0f} s:\n{state}\n{logs}\n{node.logs(1500)}")


def router_url(cp) -> str:
    ip = cp.kubectl("get", "service", f"{FULL}-router", "-n", NS, "-o", "jsonpath={.spec.clusterIP}").stdout
    port = cp.kubectl("get", "service", f"{FULL}-router", "-n", NS, "-o",
                      "jsonpath={.spec.ports[0].port}").stdout
    return f"http://{ip}:{port}"


def stream_chat(url: str, content: str, max_tokens: int = 12) -> tuple[str, str]:
    """(text, finish_reason) of one streamed chat through the official client."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    text, finish = "", ""
    for chunk in client.chat.completions.create(model=client.models.list().data[0].id, stream=True,
                                                max_tokens=max_tokens, temperature=0,
                                                messages=[{"role": "user", "content": content}]):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def decode_placements(url: str) -> dict[str, float]:
    import urllib.request

    body = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    out: dict[str, float] = {}
    for line in body.splitlines():
        if line.startswith("splitfire_router_routing_decisions_total{") and 'role="decode"' in line:
            endpoint = line.split('endpoint="', 1)[1].split('"', 1)[0]
            out[endpoint] = out.get(endpoint, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.timeout(1500)  # (with the node fixture's image imports, ~3 minutes, and pods starting on 2 cores)
def test_chart_serves_on_a_real_node(cluster, node, helm, tmp_path, smollm2_dir):
    import concurrent.futures
    import shutil

    cp = cluster
    chart, values = chart_for_1_20(tmp_path)
    # The model volume as a node would hold it (pre-staged hostPath), owned by the images' user, which
    # writes its weight cache there.
    vol = tmp_path / "model-volume"
    shutil.copytree(smollm2_dir, vol / "models" / smollm2_dir.name)
    subprocess.run(["chown", "-R", "1000:1000", str(vol)], check=True)
    vol.chmod(0o755)
    for parent in list(vol.parents)[:3]:
        parent.chmod(parent.stat().st_mode | 0o005)
    # The images `make image` built (Redis: Debian's, built above), the model on the node, the KV store
    # lending a little memory, requests small enough for two decode pods on two cores.
    node_values = tmp_path / "node-values.yaml"
    node_values.write_text(json.dumps({
        "image": {"worker": "localhost/splitfire-worker", "router": "localhost/splitfire-router",
                  "pullPolicy": "Never"},
        "model": {"source": "hostPath", "hostPath": {"path": str(vol)}, "name": smollm2_dir.name,
                  "servedName": "smol"},
        "redis": {"image": REDIS_IMAGE}, "kvStore": {"lendGB": 0.25}, "planner": {"enabled": False},
        "workers": {"kvCacheGB": 0.25},
        "prefill": {"resources": {"requests": {"cpu": "100m"}}},
        "decode": {"resources": {"requests": {"cpu": "100m"}}},
        "router": {"resources": {"requests": {"cpu": "50m"}}}}))
    values += ["-f", str(node_values)]
    t0 = time.monotonic()
    r = run(cp, helm, "install", REL, str(chart), "-n", NS, "--create-namespace", *values)
    assert r.returncode == 0, r.stderr
    wait_ready(cp, node, {"router": 1, "prefill": 1, "decode": 1, "redis": 1, "kv-store": 1}, 600)
    print(f"helm install: router, prefill, decode, redis, kv-store Ready (chart probes) in {time.monotonic() - t0:.0f} s",
          flush=True)

    url = router_url(cp)
    text, finish = stream_chat(url, "Say hello.")
    assert text and finish in ("stop", "length"), (text, finish)
    print(f"streamed chat through the router Service {url}: {text!r} ({finish})", flush=True)
    # The workers publish their prompts' KV blocks to the cluster store (the kv-store pod's master; short
    # prompts are prefilled on the decode pod itself, so every worker pod counts), and Redis holds what
    # the workers and the router keep there.
    import urllib.request

    def published() -> float:
        total = 0.0
        for pod in pods_ready(cp, "prefill") + pods_ready(cp, "decode"):
            port = next(p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])
                        if p["name"] == "metrics")
            body = urllib.request.urlopen(f"http://{pod['status']['podIP']}:{port}/metrics", timeout=30).read()
            total += sum(float(line.rsplit(" ", 1)[1]) for line in body.decode().splitlines()
                         if line.startswith("splitfire_worker_kv_store_blocks_total{") and 'op="published"' in line)
        return total

    # (A worker that found the master not answering yet re-probes it after its breaker's pause.)
    deadline = time.monotonic() + 60
    while not published() and time.monotonic() < deadline:
        stream_chat(url, f"Tell me about the number {int(time.monotonic())}.", 2)
        time.sleep(1)
    blocks = published()
    assert blocks > 0, "\n".join(cp.kubectl("logs", "-n", NS, p["metadata"]["name"], "--tail=20").stdout
                                 for p in pods_ready(cp, "prefill") + pods_ready(cp, "decode"))
    redis_pod = pods_ready(cp, "redis")[0]["metadata"]["name"]
    keys = int(cp.kubectl("exec", "-n", NS, redis_pod, "--", "redis-cli", "dbsize").stdout.strip())
    assert keys > 0
    print(f"KV store: the worker pods published {blocks:.0f} blocks to it; Redis holds {keys} keys", flush=True)

    # (No --logs: the chart deletes a test pod that succeeded, so a cluster keeps no leftovers.)
    r = run(cp, helm, "test", REL, "-n", NS, "--timeout", "5m")
    assert r.returncode == 0 and "Phase:          Succeeded" in r.stdout, r.stdout + r.stderr
    print("helm test: the chart's test pod (one chat completion through the Service) Succeeded", flush=True)

    r = run(cp, helm, "upgrade", REL, str(chart), "-n", NS, *values, "--set", "decode.replicas=2")
    assert r.returncode == 0, r.stderr
    wait_ready(cp, node, {"router": 1, "prefill": 1, "decode": 2}, 600)
    decode_ips = {p["status"]["podIP"] for p in pods_ready(cp, "decode")}
    before = decode_placements(url)
    deadline = time.monotonic() + 120  # the router rediscovers the headless Service's addresses
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        while time.monotonic() < deadline:
            list(pool.map(lambda i: stream_chat(url, f"Count to {i}.", 4), range(8)))
            after = decode_placements(url)
            used = {e.split(":")[0] for e, n in after.items() if n > before.get(e, 0)}
            if decode_ips <= used:
                break
    assert decode_ips <= used, (decode_ips, after)
    print(f"helm upgrade: 2 decode pods Ready; the router placed streams on both ({sorted(used)})", flush=True)

    victim = pods_ready(cp, "decode")[0]["metadata"]["name"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        cp.kubectl("delete", "pod", victim, "-n", NS, "--grace-period=0", "--force", check=False)
        results = list(pool.map(lambda i: stream_chat(url, f"Name a color, {i}.", 4), range(8)))
    assert all(t and f for t, f in results), results
    wait_ready(cp, node, {"router": 1, "prefill": 1, "decode": 2}, 600)
    print(f"killed decode pod {victim}: 8 streams after it served, Deployment replaced it", flush=True)

    r = run(cp, helm, "rollback", REL, "1", "-n", NS)
    assert r.returncode == 0, r.stderr
    wait_ready(cp, node, {"router": 1, "prefill": 1, "decode": 1}, 300)
    text, finish = stream_chat(url, "Say hello.")
    assert text and finish, (text, finish)
    print("helm rollback: 1 decode pod, still serving", flush=True)

    planner_scales_decode_under_a_load_step(cp, node, helm, chart, values, url, tmp_path)

    r = run(cp, helm, "uninstall", REL, "-n", NS)
    assert r.returncode == 0, r.stderr
    wait(lambda: not objects(cp, "all,configmaps,serviceaccounts,roles,rolebindings,networkpolicies"), 180,
         what="nothing of the release left")
    wait(lambda: not [c for c in node.ctr("containers", "ls", "-q").stdout.decode().split()], 120,
         what="no container left on the node")
    print("helm uninstall: no object, no container left", flush=True)


def planner_scales_decode_under_a_load_step(cp, node, helm, chart: Path, values: list[str], url: str,
                                            tmp_path: Path) -> None:
    """The planner pod (`planner.enabled`): under a load step through the router's Service it reads the router's
    /metrics, adds a decode pod through the Deployment's scale subresource (its own service account, from inside
    the cluster: the `kubernetes` Service), the router places streams on the new pod; when the load falls it
    drains one decode pod, and no request fails meanwhile. The profile says one decode pod serves 4 tokens/s
    within the ITL SLO, so four concurrent streams (~13 tokens/s on 2 cores) want more than the two allowed, and a
    4-token request every 3 s fits one. The ITL SLO is loose: on 2 cores shared by seven pods and the control
    plane, one stream's tokens come 0.5-2 s apart, and the test is of the load, not of this machine's speed."""
    import concurrent.futures
    import threading

    planner_values = tmp_path / "planner-values.yaml"
    planner_values.write_text(json.dumps({"planner": {
        "enabled": True, "profile": {"prefill_tps": 1e6, "decode_itl": {"1": 0.25, "2": 60.0}},
        "ttftSLO": 60, "itlSLO": 5, "interval": 5, "sample": 1, "startup": 10,
        "minPrefill": 1, "maxPrefill": 1, "minDecode": 1, "maxDecode": 2,
        "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}}}))
    r = run(cp, helm, "upgrade", REL, str(chart), "-n", NS, *values, "-f", str(planner_values))
    assert r.returncode == 0, r.stderr
    wait_ready(cp, node, {"router": 1, "prefill": 1, "decode": 1, "planner": 1}, 300)
    planner_pod = pods_ready(cp, "planner")[0]["metadata"]["name"]

    def planner_log() -> str:
        return cp.kubectl("logs", "-n", NS, planner_pod, "--tail=2000", check=False).stdout

    def decode_replicas() -> int:
        return int(cp.kubectl("get", "deployment", f"{FULL}-decode", "-n", NS, "-o",
                              "jsonpath={.spec.replicas}").stdout)

    wait(lambda: "event=planner_decision" in planner_log(), 120, what="the planner's first decision")
    print("planner pod Ready and deciding from the router's /metrics", flush=True)

    failures: list[str] = []
    served = [0]
    heavy = threading.Event()
    stop = threading.Event()

    def client(i: int) -> None:
        while not stop.is_set():
            if i and not heavy.is_set():  # (light load: client 0 alone, a 4-token request every 3 s)
                time.sleep(0.2)
                continue
            try:
                text, finish = stream_chat(url, f"Write about the number {i}.", 32 if heavy.is_set() else 4)
                assert finish, (text, finish)
                served[0] += 1
            except Exception as e:  # (every failed request is recorded: the assertion below names them)
                failures.append(f"{type(e).__name__}: {e}")
            if not heavy.is_set():
                time.sleep(3)

    t0 = time.monotonic()
    heavy.set()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(client, i) for i in range(4)]
        try:
            wait(lambda: decode_replicas() == 2, 180, what="the planner scaling decode to 2")
            print(f"load step (4 streams): the planner set decode to 2 replicas after {time.monotonic() - t0:.0f} s",
                  flush=True)
            wait_ready(cp, node, {"router": 1, "prefill": 1, "decode": 2, "planner": 1}, 600)
            decode_ips = {p["status"]["podIP"] for p in pods_ready(cp, "decode")}
            before = decode_placements(url)

            def placed_on_both() -> bool:
                used = {e.split(":")[0] for e, n in decode_placements(url).items() if n > before.get(e, 0)}
                return decode_ips <= used

            try:
                wait(placed_on_both, 180, what="streams placed on both decode pods")
            except AssertionError as e:
                decisions = [line for line in planner_log().splitlines() if "event=planner_" in line][-30:]
                raise AssertionError(f"{e}: decode pods {sorted(decode_ips)}, now "
                                     f"{[p['status']['podIP'] for p in pods_ready(cp, 'decode')]}; placements "
                                     f"{before} -> {decode_placements(url)}; the planner:\n" + "\n".join(decisions)
                                     ) from None
            print(f"the new decode pod Ready {time.monotonic() - t0:.0f} s after the step; the router places on both",
                  flush=True)
            heavy.clear()
            t1 = time.monotonic()
            wait(lambda: decode_replicas() == 1, 300, what="the planner draining a decode pod")
            wait_ready(cp, node, {"router": 1, "prefill": 1, "decode": 1, "planner": 1}, 300)
            print(f"light load: the planner drained one decode pod {time.monotonic() - t1:.0f} s after the fall",
                  flush=True)
            time.sleep(6)  # (a few more requests on the pod that stays)
        finally:
            stop.set()
            for f in futures:
                f.result()
    assert not failures, failures
    log = planner_log()
    assert "event=planner_scaled role=decode" in log and "from=2 to=1" in log, log[-3000:]
    print(f"{served[0]} requests through the step and the drain, none failed", flush=True)
