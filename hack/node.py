"""The real-node builder/runner: kubelet, kube-scheduler, containerd, runc, CNI and local images.

Owned by the real-node helper (issue 10, items 2 and 3). This module builds, caches and installs
the binaries a real Kubernetes node needs on the test machine, next to the Go-built control plane
of hack/controlplane.py, so tests/fixtures/node.py can start a node joined to it.
(First version: the build follows.)
"""
