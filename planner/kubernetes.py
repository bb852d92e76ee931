"""The planner's Kubernetes actuator: each role's Deployment sized through its `scale` subresource.

Only `get` and `patch` on `deployments/scale` of the two named Deployments are needed (the chart's
planner Role grants exactly that). Credentials: in a pod, its service account (token and CA under
/var/run/secrets/kubernetes.io/serviceaccount, the API at $KUBERNETES_SERVICE_HOST); outside,
a kubeconfig's current context (client certificate or bearer token). Scaling down is the Deployment
controller's: it deletes a pod, whose worker drains on SIGTERM within terminationGracePeriodSeconds.
"""

from __future__ import annotations

import json
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass
class KubeAPI:
    server: str
    ssl_context: ssl.SSLContext
    token: str = ""

    @classmethod
    def in_cluster(cls) -> KubeAPI:
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host or not (SA_DIR / "token").is_file():
            raise RuntimeError("not in a Kubernetes pod (no KUBERNETES_SERVICE_HOST or service-account token); "
                               "give --kubeconfig")
        ctx = ssl.create_default_context(cafile=str(SA_DIR / "ca.crt"))
        return cls(f"https://{host}:{port}", ctx, (SA_DIR / "token").read_text().strip())

    @classmethod
    def from_kubeconfig(cls, path: str | Path) -> KubeAPI:
        import yaml

        cfg = yaml.safe_load(Path(path).read_text())
        ctx_name = cfg.get("current-context")
        context = next(c["context"] for c in cfg["contexts"] if c["name"] == ctx_name)
        cluster = next(c["cluster"] for c in cfg["clusters"] if c["name"] == context["cluster"])
        user = next(u["user"] for u in cfg["users"] if u["name"] == context["user"])
        ctx = ssl.create_default_context(cafile=cluster.get("certificate-authority"))
        if user.get("client-certificate"):
            ctx.load_cert_chain(user["client-certificate"], user["client-key"])
        return cls(cluster["server"], ctx, user.get("token", ""))

    async def request(self, session: aiohttp.ClientSession, method: str, path: str,
                      body: dict[str, Any] | None = None) -> dict[str, Any]:
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if body is not None:
            headers["Content-Type"] = "application/merge-patch+json"
        async with session.request(method, self.server + path, headers=headers, ssl=self.ssl_context,
                                   data=None if body is None else json.dumps(body)) as r:
            text = await r.text()
            if r.status >= 300:
                raise PermissionError(f"{method} {path}: {r.status} {text[:300]}") if r.status in (401, 403) else \
                    RuntimeError(f"{method} {path}: {r.status} {text[:300]}")
            return json.loads(text)


@dataclass
class DeploymentScaler:
    """The prefill and decode Deployments of one namespace, read and sized by replicas."""

    api: KubeAPI
    namespace: str
    deployments: dict[str, str]  # role -> Deployment name

    def _path(self, role: str) -> str:
        return f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{self.deployments[role]}/scale"

    async def replicas(self, session: aiohttp.ClientSession, role: str) -> int:
        return int((await self.api.request(session, "GET", self._path(role)))["spec"].get("replicas", 0))

    async def scale(self, session: aiohttp.ClientSession, role: str, replicas: int) -> None:
        await self.api.request(session, "PATCH", self._path(role), {"spec": {"replicas": replicas}})
