"""The chart's image, built here without a container engine (hack/image.py), is a valid OCI image
whose root file system runs offloadpool.

The layout is checked the way a runtime reads it (index -> manifest -> config and layers, every
digest and size), then its layers are unpacked in order into a directory and the image's own
Python runs there in a chroot. The Dockerfile is checked to install the same thing.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.node_image import REPO, build_image, image_tool, unpack

pytestmark = pytest.mark.root  # builds images, mounts, cgroups: root only


def build() -> tuple[Path, str, float]:
    return build_image()


@pytest.fixture(scope="module")
def layout() -> Path:
    path, _, _ = build()
    return path


def blob(layout: Path, digest: str) -> bytes:
    algo, hexdigest = digest.split(":", 1)
    assert algo == "sha256"
    data = (layout / "blobs" / "sha256" / hexdigest).read_bytes()
    assert hashlib.sha256(data).hexdigest() == hexdigest, f"blob {digest} does not match its digest"
    return data


def descriptor_content(layout: Path, desc: dict[str, Any]) -> bytes:
    data = blob(layout, desc["digest"])
    assert len(data) == desc["size"], f"{desc['digest']}: size {len(data)} != descriptor's {desc['size']}"
    return data


def manifest_and_config(layout: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    index = json.loads((layout / "index.json").read_text())
    assert index["schemaVersion"] == 2 and len(index["manifests"]) == 1
    entry = index["manifests"][0]
    manifest = json.loads(descriptor_content(layout, entry))
    config = json.loads(descriptor_content(layout, manifest["config"]))
    return entry, manifest, config


@pytest.fixture(scope="module")
def rootfs(layout: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The image's layers unpacked in order (whiteouts applied), as a runtime would."""
    root = tmp_path_factory.mktemp("image") / "rootfs"
    unpack(layout, root)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_layout_is_a_valid_oci_image_named_as_the_chart_expects(layout: Path) -> None:
    assert json.loads((layout / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    entry, manifest, config = manifest_and_config(layout)
    tool = image_tool()
    assert entry["mediaType"] == manifest["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    assert entry["platform"] == {"architecture": "amd64", "os": "linux"}
    # the chart's default image: values.yaml's repository with the chart's appVersion as tag
    chart = (REPO / "charts" / "offloadpool" / "Chart.yaml").read_text()
    values = (REPO / "charts" / "offloadpool" / "values.yaml").read_text()
    app_version = re.search(r'^appVersion:\s*"?([^"\s]+)"?', chart, re.M)
    repository = re.search(r"^\s+repository:\s*(\S+)", values, re.M)
    assert app_version and repository
    assert entry["annotations"]["io.containerd.image.name"] == f"{repository[1]}:{app_version[1]}"
    assert config["architecture"] == "amd64" and config["os"] == "linux"
    assert len(manifest["layers"]) == len(config["rootfs"]["diff_ids"]) == 3  # base, deps, app
    for layer, diff_id in zip(manifest["layers"], config["rootfs"]["diff_ids"], strict=True):
        assert layer["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip"
        data = descriptor_content(layout, layer)
        assert "sha256:" + hashlib.sha256(gzip.decompress(data)).hexdigest() == diff_id
    assert config["config"]["Cmd"] == tool.CMD
    assert f"PATH={tool.PREFIX}/bin:" in " ".join(config["config"]["Env"])


def test_the_image_runs_offloadpool(rootfs: Path, layout: Path) -> None:
    _, _, config = manifest_and_config(layout)
    tool = image_tool()
    for script in ("offloadpool", "offloadpool-agent", "offloadpool-operator"):
        exe = rootfs / tool.PREFIX.lstrip("/") / "bin" / script
        assert exe.is_file() and os.access(exe, os.X_OK), f"{script} is not in the image"
    env = dict(e.split("=", 1) for e in config["config"]["Env"])
    code = (
        "import offloadpool, offloadpool.agent, offloadpool.agent.main, offloadpool.operator.main;"
        "import kopf, kubernetes;"
        "print(offloadpool.__version__, offloadpool.__file__)"
    )
    out = subprocess.run(
        ["chroot", str(rootfs), "python", "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    installed_version, where = out.stdout.split()
    assert installed_version == tool.version()
    assert where.startswith(f"{tool.PREFIX}/lib/python3"), where  # the wheel, installed; no source tree
    assert not (rootfs / "src").exists()
    cli = subprocess.run(
        ["chroot", str(rootfs), "offloadpool", "--help"], env=env, capture_output=True, text=True, timeout=120
    )
    assert cli.returncode == 0 and "provision" in cli.stdout, cli.stderr


def test_the_charts_user_has_a_name_in_the_image(rootfs: Path, layout: Path) -> None:
    """The chart runs the operator as uid 65532; kopf asks getpass.getuser() at start, which
    fails for a uid with no passwd entry (the operator pod crash-looped with KeyError)."""
    _, _, config = manifest_and_config(layout)
    env = {k: v for k, v in (e.split("=", 1) for e in config["config"]["Env"])}
    chart = (REPO / "charts" / "offloadpool" / "templates" / "deployment.yaml").read_text()
    assert f"runAsUser: {image_tool().RUN_AS}" in chart
    out = subprocess.run(
        [
            "chroot",
            "--userspec=65532:65532",
            str(rootfs),
            "python",
            "-c",
            "import getpass; print(getpass.getuser())",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.strip() == "offloadpool", out.stderr


def test_dockerfile_installs_what_the_build_installs() -> None:
    tool = image_tool()
    dockerfile = (REPO / "Dockerfile").read_text()
    assert re.search(rf"^FROM debian:{tool.SUITE}-slim$", dockerfile, re.M), (
        "the base differs from the build's"
    )
    apt = re.search(r"apt-get install -y --no-install-recommends ([^\\\n]+)", dockerfile)
    assert apt and tuple(apt[1].split()) == tool.PACKAGES
    assert "RUN python3 /src/hack/image.py install /src" in dockerfile
    cmd = re.search(r"^CMD (\[.*\])$", dockerfile, re.M)
    assert cmd and json.loads(cmd[1]) == tool.CMD


def test_a_second_build_is_cached(layout: Path) -> None:
    """Unchanged source: the build reuses the layout (its time is in docs, not asserted). (The
    working tree may change between two builds while someone edits it; then the key differs and
    a rebuild is right, so the pair is tried again.)"""
    tool = image_tool()
    for _ in range(3):
        key = tool.image_key()
        first, _, _ = build()
        again, stderr, _ = build()
        if tool.image_key() == key == again.name:
            break
    else:
        pytest.fail("the source kept changing between builds")
    assert again == first and "cached" in stderr, stderr
