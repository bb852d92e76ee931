"""A real Kubernetes control plane on this machine for `make test-k8s`: etcd (Debian's etcd-server),
kube-apiserver, kube-controller-manager and kube-scheduler (built from Debian's kubernetes source by
`kube_build.sh`), TLS and service-account keys made with openssl, an admin kubeconfig.

    with ControlPlane(workdir) as cp:      # started and ready (readyz), stopped on exit
        cp.kubectl("get", "namespaces")

Not here (yet): a kubelet with containerd to run the pods, cluster DNS and kube-proxy — so Deployments
get their ReplicaSets and Pods, which stay Pending (what `make test-k8s` checks is said in tests/test_k8s.py).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

# The node's pod bridge: pods get POD_SUBNET.2-254; its gateway (the host side: node IP, DNS) is POD_GATEWAY. The
# API server listens on every address and advertises the gateway, so a pod (the planner) reaches it through the
# `kubernetes` Service (10.96.0.1, kube-proxy's DNAT); TLS and RBAC guard it as on any cluster.
POD_SUBNET = "10.244.0"
POD_GATEWAY = f"{POD_SUBNET}.1"


def kube_bin() -> Path:
    """The cached binaries (built on first use: minutes)."""
    out = subprocess.run(["bash", str(ROOT / "helm" / "tools" / "kube_build.sh")], check=True, capture_output=True,
                         text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(d: Path) -> None:
    """A CA, the API server's serving certificate, an admin client certificate (system:masters) and the
    service-account signing key pair."""
    d.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
             "-subj", "/CN=splitfire-test-ca", cwd=d)
    (d / "san.cnf").write_text(
        f"[req]\ndistinguished_name=dn\n[dn]\n[ext]\nsubjectAltName=IP:127.0.0.1,IP:10.96.0.1,IP:{POD_GATEWAY},"
        "DNS:localhost,"
        "DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\n"
        "extendedKeyUsage=serverAuth\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "apiserver.key", "-out", "apiserver.csr", "-subj",
             "/CN=kube-apiserver", cwd=d)
    _openssl("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out",
             "apiserver.crt", "-days", "2", "-extfile", "san.cnf", "-extensions", "ext", cwd=d)
    (d / "client.cnf").write_text("[ext]\nextendedKeyUsage=clientAuth\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "admin.key", "-out", "admin.csr", "-subj",
             "/O=system:masters/CN=admin", cwd=d)
    _openssl("x509", "-req", "-in", "admin.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out",
             "admin.crt", "-days", "2", "-extfile", "client.cnf", "-extensions", "ext", cwd=d)
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=d)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)


class Processes:
    """Named child processes, each writing DIR/NAME.log: started, checked for early exits (failing with
    every log's tail), and stopped newest first. Shared by the control plane and the node."""

    def __init__(self, log_dir: Path):
        self.dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.dir / f"{name}.log", "w")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((name, p))
        return p

    def running(self, name: str) -> bool:
        return any(n == name and p.poll() is None for n, p in self.procs)

    def stop(self, timeout: float, name: str | None = None) -> None:
        """Every process (or only those called `name`): SIGTERM, then SIGKILL after `timeout` seconds."""
        chosen = [(n, p) for n, p in reversed(self.procs) if name is None or n == name]
        for _, p in chosen:
            if p.poll() is None:
                p.terminate()
        for _, p in chosen:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = [(n, p) for n, p in self.procs if (n, p) not in chosen]

    def check_alive(self) -> None:
        dead = [n for n, p in self.procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{', '.join(dead)} exited:\n" + self.logs())

    def logs(self, tail: int = 2000) -> str:
        return "\n".join(f"--- {n}\n{(self.dir / f'{n}.log').read_text(errors='replace')[-tail:]}"
                         for n, _ in self.procs if (self.dir / f"{n}.log").is_file())


class Started:
    """`with X() as x:` starts x (stopping what did start if the start fails) and stops it after."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self):  # (returns the subclass's own type)
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ControlPlane(Started):
    def __init__(self, workdir: Path, bin_dir: Path | None = None):
        self.dir = Path(workdir)
        self.bin = bin_dir
        self.procs = Processes(self.dir)
        self.api_port = free_port()
        self.kubeconfig = self.dir / "admin.kubeconfig"

    # -- lifecycle -----------------------------------------------------------------------------


    def start(self) -> None:
        self.bin = self.bin or kube_bin()
        pki = self.dir / "pki"
        make_pki(pki)
        etcd_port, peer = free_port(), free_port()
        self.procs.spawn("etcd", [shutil.which("etcd") or "etcd", "--data-dir", str(self.dir / "etcd"),
                             "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
                             "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
                             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-cluster", f"default=http://127.0.0.1:{peer}"])
        self.procs.spawn("kube-apiserver", [
            str(self.bin / "kube-apiserver"), f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=0.0.0.0", f"--advertise-address={POD_GATEWAY}", f"--secure-port={self.api_port}",
            "--insecure-port=0", f"--tls-cert-file={pki}/apiserver.crt", f"--tls-private-key-file={pki}/apiserver.key",
            f"--client-ca-file={pki}/ca.crt", f"--service-account-key-file={pki}/sa.pub",
            f"--service-account-signing-key-file={pki}/sa.key", "--service-account-issuer=https://kubernetes.default.svc",
            "--service-cluster-ip-range=10.96.0.0/16", "--authorization-mode=Node,RBAC", "--allow-privileged=true",
            "--kubelet-preferred-address-types=InternalIP,Hostname"])
        self.kubeconfig.write_text(f"""apiVersion: v1
kind: Config
clusters:
- name: local
  cluster: {{server: "https://127.0.0.1:{self.api_port}", certificate-authority: "{pki}/ca.crt"}}
users:
- name: admin
  user: {{client-certificate: "{pki}/admin.crt", client-key: "{pki}/admin.key"}}
contexts:
- name: local
  context: {{cluster: local, user: admin}}
current-context: local
""")
        self.wait_ready("/readyz", 90)
        self.procs.spawn("kube-controller-manager", [
            str(self.bin / "kube-controller-manager"), f"--kubeconfig={self.kubeconfig}", "--leader-elect=false",
            "--port=0", f"--secure-port={free_port()}", f"--service-account-private-key-file={pki}/sa.key",
            f"--root-ca-file={pki}/ca.crt", f"--cluster-signing-cert-file={pki}/ca.crt",
            f"--cluster-signing-key-file={pki}/ca.key", "--use-service-account-credentials=true"])
        self.procs.spawn("kube-scheduler", [
            str(self.bin / "kube-scheduler"), f"--kubeconfig={self.kubeconfig}", "--leader-elect=false", "--port=0",
            f"--secure-port={free_port()}"])
        # The default namespace's service account appears once the controller-manager runs.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.kubectl("get", "serviceaccount", "default", "-o", "name", check=False).returncode == 0:
                return
            self.procs.check_alive()
            time.sleep(0.5)
        raise RuntimeError("the controller-manager did not create the default service account:\n" + self.logs())

    def stop(self) -> None:
        self.procs.stop(15)

    # -- use ---------------------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    def kubectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["kubectl", f"--kubeconfig={self.kubeconfig}", *args], capture_output=True, text=True,
                              check=check)

    def wait_ready(self, path: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.kubeconfig.is_file():
                r = self.kubectl("get", "--raw", path, check=False)
                if r.returncode == 0 and r.stdout.strip() == "ok":
                    return
            self.procs.check_alive()
            time.sleep(0.5)
        raise RuntimeError(f"the API server was not ready ({path}) after {timeout:.0f} s:\n" + self.logs())

    def logs(self, tail: int = 2000) -> str:
        return self.procs.logs(tail)
