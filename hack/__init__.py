"""The development tooling: build and run this repository's own single-node Kubernetes.

Build (pinned sources into ``$OFFLOADPOOL_CACHE``, before any virtual environment exists):
:mod:`hack.controlplane_build` (etcd, kube-apiserver, kube-controller-manager, kubectl, helm),
:mod:`hack.node_build` (kubelet, kube-scheduler, containerd, runc, CNI, the pause/busybox
images), ``hack/image.py`` (the chart's image). Run: :mod:`hack.pki` (certificates,
kubeconfigs), :mod:`hack.process` (processes that die with their parent),
:mod:`hack.controlplane` (:class:`~hack.controlplane.ControlPlane`), :mod:`hack.node_run`
(:class:`~hack.node_run.NodeRunner`, the `kubernetes` Service relay, teardown),
:mod:`hack.devcluster` (``python3 -m hack.node up``/``down`` for a person). The test fixtures
(tests/fixtures/controlplane.py, node.py) import the same classes.

Standard library only; run the command-line modules from the repository root
(``python3 -m hack.controlplane build``, ``python3 -m hack.node up``).
"""
