"""A real Kubernetes node on this machine for `make test-k8s`, joined to `kube_cluster.ControlPlane`:
containerd (Debian's, CRI with runc and the overlayfs snapshotter) running the pods, the kubelet and
kube-proxy (iptables mode) built from Debian's kubernetes source by `kube_build.sh`, pod networking
with the standard CNI bridge + host-local plugins (Debian's containernetworking-plugins) on one
bridge, and cluster DNS.

    with ControlPlane(tmp) as cp, Node(cp, tmp / "node") as node:
        node.load_image("localhost/splitfire-worker:0.1.0")   # from podman's store into containerd
        ...                                                   # pods run; Services route; names resolve

Nothing is pulled from a registry: the pod sandbox ("pause") image is a static C program built here
with gcc and wrapped by podman (`FROM scratch`), and the images a test runs are copied from podman.
Cluster DNS is dnsmasq (Debian has no CoreDNS), answering `<service>.<namespace>.svc.cluster.local`
from a hosts file this module rewrites from the API's Services and Endpoints once a second (a
headless Service's name gives its ready pods' addresses, as CoreDNS would). One node, no GPU, no
RDMA. containerd's image store is kept in `~/.cache/splitfire/k8s-node` so a second run imports
nothing; everything else (processes, pods, the bridge, iptables rules, mounts) is removed by
`stop()`.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

from kube_cluster import POD_GATEWAY, POD_SUBNET, ControlPlane, Processes, Started, free_port

NODE = "sfnode"
BRIDGE = "sfbr0"
PAUSE_IMAGE = "localhost/splitfire-pause:1"
CNI_BIN = Path("/usr/lib/cni")
PAUSE_C = r"""
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
static void quit(int s) { (void)s; _exit(0); }
static void reap(int s) { (void)s; while (waitpid(-1, 0, WNOHANG) > 0) {} }
int main(void) { signal(SIGINT, quit); signal(SIGTERM, quit); signal(SIGCHLD, reap); for (;;) pause(); }
"""
DEBIAN_PACKAGES = {"containerd": "containerd", "runc": "runc", "dnsmasq": "dnsmasq", "gcc": "gcc",
                   "iptables": "iptables", str(CNI_BIN / "bridge"): "containernetworking-plugins"}


def ensure_packages() -> None:
    """containerd, runc, dnsmasq, gcc, iptables and the CNI plugins (Debian packages), installed if missing."""
    missing = sorted({pkg for tool, pkg in DEBIAN_PACKAGES.items()
                      if not (Path(tool).exists() if tool.startswith("/") else shutil.which(tool))})
    if missing:
        subprocess.run(["apt-get", "update", "-qq"], check=True, capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", *missing], check=True, capture_output=True,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


def remove_iptables_rules() -> None:
    """What the kubelet, kube-proxy and the CNI bridge (for pods whose teardown never ran) leave in
    iptables: rules in the built-in chains that jump to a KUBE-* or CNI-* chain or carry this network's
    name, then those chains. (This machine runs no other Kubernetes.)"""
    for table in ("filter", "nat", "mangle"):
        rules = subprocess.run(["iptables", "-t", table, "-S"], capture_output=True, text=True).stdout.splitlines()
        chains = [r.split()[1] for r in rules if r.startswith("-N ") and r.split()[1].startswith(("KUBE-", "CNI-"))]
        for r in rules:
            parts = r.split()
            if parts[0] != "-A":
                continue
            builtin = parts[1] in ("INPUT", "OUTPUT", "FORWARD", "PREROUTING", "POSTROUTING")
            if builtin and ("splitfire-test" in r or any(c in parts for c in chains)):
                subprocess.run(["iptables", "-t", table, "-D", *shlex.split(r)[1:]], capture_output=True)
        for c in chains:
            subprocess.run(["iptables", "-t", table, "-F", c], capture_output=True)
        for c in chains:
            subprocess.run(["iptables", "-t", table, "-X", c], capture_output=True)


class Node(Started):
    def __init__(self, cp: ControlPlane, workdir: Path, cache: Path | None = None):
        self.cp = cp
        self.dir = Path(workdir)
        home = Path(os.environ.get("SPLITFIRE_HOME", Path.home() / ".cache" / "splitfire"))
        self.cache = cache or home / "k8s-node"
        self.sock = self.dir / "containerd" / "containerd.sock"
        self.procs = Processes(self.dir)
        self.dns_hosts = self.dir / "dns" / "hosts"
        self._dns_stop = threading.Event()
        self._dns_thread: threading.Thread | None = None
        self.gateway = POD_GATEWAY

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        ensure_packages()
        self.dir.mkdir(parents=True, exist_ok=True)
        for key, value in (("net/ipv4/ip_forward", "1"), ("net/bridge/bridge-nf-call-iptables", "1")):
            Path("/proc/sys", key).write_text(value)
        remove_iptables_rules()  # a crashed earlier run's
        self._start_containerd()
        self._remove_all_containers()  # ... and its containers (the store outlives runs)
        self._ensure_pause_image()
        self._start_network()
        self._start_dns()
        self._start_kubelet()
        self._start_kube_proxy()
        self.wait_ready(120)

    def stop(self) -> None:
        """Pods' containers, then the node's processes, then what they left in the kernel."""
        self._dns_stop.set()
        if self._dns_thread is not None:
            self._dns_thread.join(5)
        if self.procs.running("kubelet"):
            self._delete_pods_through_kubelet()
        self.procs.stop(20, "kubelet")
        if self.sock.exists():
            self._remove_all_containers()
        self.procs.stop(20)
        bin_dir = self.cp.bin
        if bin_dir is not None and (bin_dir / "kube-proxy").exists():
            subprocess.run([str(bin_dir / "kube-proxy"), "--cleanup"], capture_output=True)
        remove_iptables_rules()
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)
        # Anything still mounted under the state directories (a container's rootfs, a sandbox's shm).
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
                  if line.split()[1].startswith((str(self.dir), str(self.cache)))]
        for m in sorted(mounts, key=len, reverse=True):
            subprocess.run(["umount", "-l", m], capture_output=True)

    def _delete_pods_through_kubelet(self, timeout: float = 60) -> None:
        """Every pod deleted and its sandbox torn down by the kubelet (network included), so nothing is
        left for the forced removal below."""
        self.cp.kubectl("delete", "pods", "--all", "--all-namespaces", "--grace-period=0", "--force", "--wait=false",
                        check=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.ctr("tasks", "ls", "-q", check=False).stdout.decode().split():
                return
            time.sleep(0.5)

    # -- containerd ------------------------------------------------------------------------------

    def ctr(self, *args: str, check: bool = True, input: bytes | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(["ctr", "--address", str(self.sock), "--namespace", "k8s.io", *args], check=check,
                              capture_output=True, input=input)

    def _start_containerd(self) -> None:
        root = self.cache / "containerd"
        state = self.dir / "containerd"
        root.mkdir(parents=True, exist_ok=True)
        state.mkdir(parents=True, exist_ok=True)
        (self.dir / "cni" / "net.d").mkdir(parents=True, exist_ok=True)
        config = self.dir / "containerd.toml"
        config.write_text(f"""version = 2
root = "{root}"
state = "{state / 'state'}"
[grpc]
  address = "{self.sock}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  enable_selinux = false
  # The sandbox may not lower its oom_score_adj (the pause container asks for -998): keep containerd's floor.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{self.dir / 'cni' / 'net.d'}"
""")
        self.procs.spawn("containerd", ["containerd", "--config", str(config)])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.sock.exists() and self.ctr("version", check=False).returncode == 0:
                return
            self.procs.check_alive()
            time.sleep(0.2)
        raise RuntimeError("containerd did not answer on its socket:\n" + self.logs())

    def has_image(self, ref: str) -> bool:
        out = self.ctr("images", "ls", "-q").stdout.decode().split()
        return ref in out or f"docker.io/{ref}" in out

    def load_image(self, ref: str) -> float:
        """Copy `ref` from podman's store into containerd's k8s.io namespace (skipped when an image of that
        name and the same ID is there already). Returns seconds spent."""
        t0 = time.monotonic()
        podman_id = subprocess.run(["podman", "image", "inspect", "--format", "{{.Id}}", ref], check=True,
                                   capture_output=True, text=True).stdout.strip()
        mark = self.cache / "imported" / ref.replace("/", "_").replace(":", "_")
        if self.has_image(ref) and mark.is_file() and mark.read_text() == podman_id:
            return 0.0
        archive = self.dir / "image.tar"
        subprocess.run(["podman", "save", "--format", "docker-archive", "-o", str(archive), ref], check=True,
                       capture_output=True)
        self.ctr("images", "import", "--snapshotter", "overlayfs", str(archive))
        archive.unlink()
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.write_text(podman_id)
        return time.monotonic() - t0

    def _ensure_pause_image(self) -> None:
        if subprocess.run(["podman", "image", "exists", PAUSE_IMAGE]).returncode != 0:
            build = self.dir / "pause-build"
            build.mkdir(exist_ok=True)
            (build / "pause.c").write_text(PAUSE_C)
            subprocess.run(["gcc", "-Os", "-static", "-o", str(build / "pause"), str(build / "pause.c")], check=True,
                           capture_output=True)
            (build / "Containerfile").write_text('FROM scratch\nCOPY pause /pause\nENTRYPOINT ["/pause"]\n')
            subprocess.run(["podman", "build", "-q", "--network", "none", "-t", PAUSE_IMAGE, str(build)], check=True,
                           capture_output=True)
        self.load_image(PAUSE_IMAGE)

    def _remove_all_containers(self) -> None:
        for task in self.ctr("tasks", "ls", "-q", check=False).stdout.decode().split():
            self.ctr("tasks", "kill", "-s", "SIGKILL", task, check=False)
        deadline = time.monotonic() + 15
        while self.ctr("tasks", "ls", "-q", check=False).stdout.decode().split() and time.monotonic() < deadline:
            for task in self.ctr("tasks", "ls", "-q", check=False).stdout.decode().split():
                self.ctr("tasks", "delete", "-f", task, check=False)
            time.sleep(0.3)
        for c in self.ctr("containers", "ls", "-q", check=False).stdout.decode().split():
            self.ctr("containers", "rm", c, check=False)
        for ns in Path("/var/run/netns").glob("cni-*") if Path("/var/run/netns").is_dir() else []:
            subprocess.run(["ip", "netns", "del", ns.name], capture_output=True)

    # -- network and DNS -------------------------------------------------------------------------

    def _start_network(self) -> None:
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)
        subprocess.run(["ip", "link", "add", BRIDGE, "type", "bridge"], check=True)
        subprocess.run(["ip", "addr", "add", f"{self.gateway}/24", "dev", BRIDGE], check=True)
        subprocess.run(["ip", "link", "set", BRIDGE, "up"], check=True)
        ipam = self.dir / "cni" / "ipam"
        conf = {"cniVersion": "0.4.0", "name": "splitfire-test", "plugins": [
            {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": True, "hairpinMode": True,
             "ipam": {"type": "host-local", "ranges": [[{"subnet": f"{POD_SUBNET}.0/24", "gateway": self.gateway}]],
                      "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(ipam)}},
            {"type": "portmap", "capabilities": {"portMappings": True}}]}
        (self.dir / "cni" / "net.d" / "10-splitfire.conflist").write_text(json.dumps(conf, indent=1))

    def _start_dns(self) -> None:
        self.dns_hosts.parent.mkdir(parents=True, exist_ok=True)
        self.dns_hosts.write_text("")
        self._dnsmasq = self.procs.spawn("dnsmasq", [
            "dnsmasq", "--keep-in-foreground", "--no-resolv", "--no-hosts", "--bind-interfaces",
            f"--listen-address={self.gateway}", "--port=53", "--local=/cluster.local/", "--domain-needed",
            f"--addn-hosts={self.dns_hosts}", "--log-facility=-", "--user=root", "--pid-file="])
        self._dns_thread = threading.Thread(target=self._sync_dns, name="kube-dns-sync", daemon=True)
        self._dns_thread.start()

    def dns_records(self) -> list[tuple[str, str]]:
        """(address, name) for every Service: its cluster IP, or for a headless one each ready endpoint."""
        r = self.cp.kubectl("get", "services,endpoints", "-A", "-o", "json", check=False)
        if r.returncode != 0:
            return []
        items = json.loads(r.stdout)["items"]
        records = []
        endpoints = {(i["metadata"]["namespace"], i["metadata"]["name"]): i for i in items if i["kind"] == "Endpoints"}
        for svc in (i for i in items if i["kind"] == "Service"):
            ns, name = svc["metadata"]["namespace"], svc["metadata"]["name"]
            fqdn = f"{name}.{ns}.svc.cluster.local"
            if svc["spec"].get("clusterIP") not in (None, "", "None"):
                records.append((svc["spec"]["clusterIP"], fqdn))
                continue
            for subset in endpoints.get((ns, name), {}).get("subsets") or []:
                records += [(a["ip"], fqdn) for a in subset.get("addresses") or []]
        return sorted(records)

    def _sync_dns(self) -> None:
        last = None
        while not self._dns_stop.wait(1.0):
            records = self.dns_records()
            if records != last:
                self.dns_hosts.write_text("".join(f"{ip} {name}\n" for ip, name in records))
                if self._dnsmasq.poll() is None:
                    self._dnsmasq.send_signal(signal.SIGHUP)
                last = records

    # -- kubelet and kube-proxy ------------------------------------------------------------------

    def _start_kubelet(self) -> None:
        assert self.cp.bin is not None
        kdir = self.dir / "kubelet"
        kdir.mkdir(exist_ok=True)
        resolv = self.dir / "resolv.conf"
        resolv.write_text("")  # pods resolve through the cluster DNS only
        self.kubelet_port = free_port()
        self.procs.spawn("kubelet", [
            str(self.cp.bin / "kubelet"), f"--kubeconfig={self.cp.kubeconfig}", "--container-runtime=remote",
            f"--container-runtime-endpoint=unix://{self.sock}", "--runtime-request-timeout=15m",
            f"--root-dir={kdir}", f"--cert-dir={kdir / 'pki'}", f"--hostname-override={NODE}", f"--node-ip={self.gateway}",
            "--cgroup-driver=cgroupfs", "--cgroups-per-qos=false", "--enforce-node-allocatable=",
            "--fail-swap-on=false", f"--port={self.kubelet_port}", "--read-only-port=0", "--healthz-port=0",
            f"--cluster-dns={self.gateway}", "--cluster-domain=cluster.local", f"--resolv-conf={resolv}",
            "--eviction-hard=memory.available<100Mi,nodefs.available<1%,imagefs.available<1%",
            "--image-gc-high-threshold=100", "--image-gc-low-threshold=99", "--serialize-image-pulls=false",
            "--anonymous-auth=true", "--authorization-mode=AlwaysAllow", f"--volume-plugin-dir={kdir / 'plugins'}",
            "--max-pods=40", "--v=1"])

    def _start_kube_proxy(self) -> None:
        assert self.cp.bin is not None
        self.procs.spawn("kube-proxy", [
            str(self.cp.bin / "kube-proxy"), f"--kubeconfig={self.cp.kubeconfig}", f"--hostname-override={NODE}",
            "--proxy-mode=iptables", f"--cluster-cidr={POD_SUBNET}.0/24", "--conntrack-max-per-core=0",
            "--conntrack-tcp-timeout-established=0", "--conntrack-tcp-timeout-close-wait=0",
            f"--metrics-bind-address=127.0.0.1:{free_port()}", f"--healthz-bind-address=127.0.0.1:{free_port()}"])

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.cp.kubectl("get", "node", NODE, "-o",
                                "jsonpath={.status.conditions[?(@.type=='Ready')].status}", check=False)
            if r.returncode == 0 and r.stdout.strip() == "True":
                return
            self.procs.check_alive()
            time.sleep(0.5)
        raise RuntimeError(f"node {NODE} not Ready after {timeout:.0f} s:\n" + self.logs())

    def logs(self, tail: int = 3000) -> str:
        return self.procs.logs(tail)
