# The image the Helm chart runs: the operator and the node agent are console scripts of the one
# offloadpool distribution. For users with a container engine. The development and CI machines
# have none: they build the same image with `python3 hack/image.py build` (debootstrap of the same
# Debian release with the same two packages, then the same install command below), as an OCI
# layout; see docs/real-node.md. Keep the two in step: the base, the packages, the install.
FROM debian:bookworm-slim
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
COPY . /src
# A venv at /opt/offloadpool with /src[operator]: the wheel built from the source and its
# dependencies (hack/image.py install, the command hack/image.py build runs in its chroot).
RUN python3 /src/hack/image.py install /src && rm -rf /src
ENV PATH=/opt/offloadpool/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# The agent mounts through mount(2) via ctypes and needs nothing else from the OS.
ENTRYPOINT []
CMD ["offloadpool-operator", "--standalone"]
