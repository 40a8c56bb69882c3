"""The operator's admission webhook server: options, certificates, and keeping the webhook
configurations pointed at it. The handlers are in ``admission_handlers``; the policy (what a pod
gets, when it is refused) in ``admission``.

kopf's ``kopf.WebhookServer`` is the server (HTTPS with aiohttp, one path per handler id, its
certificate files re-read every minute and the server restarted with renewed ones), but started
here within ``endpoints.HttpBounds`` (idle timeout, connection cap, body cap), which kopf's own
loop does not pass to aiohttp. This module adds
what kopf's own management of webhook configurations cannot do (see ``webhookconfig``): before
the server first starts, after each of its restarts, and every ``resync`` seconds, the two
configurations are patched to this server's client config and CA bundle when they differ; made
certificates are rotated and renewed (``certs``: the serving certificate moves to a new CA only
once the configurations read back trust it, so no restart or rotation has a moment in which the
API server cannot verify what is served).

Off unless ``--webhook`` is given: an operator without it registers no admission handler.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import logging
import shutil
import tempfile
import time
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp.web
import kopf

from offloadpool.api.pods import WEBHOOK_CONFIGURATION_NAME

from . import certs, endpoints
from .admission import InjectionSettings
from .config import OperatorConfig
from .webhookconfig import Configurator, Endpoint, excluded_namespaces

log = logging.getLogger(__name__)

#: After writing a new bundle at start-up, wait this long before serving: the API server's
#: cache of the configurations follows a write within milliseconds.
SETTLE_SECONDS = 1.0


@dataclass(frozen=True)
class WebhookOptions:
    """How the webhook is served and reached (``--webhook-*`` flags, whose defaults these are)."""

    enabled: bool = False
    """Serve the webhook and keep its configurations current (``--webhook``)."""
    listen: str = "0.0.0.0"
    """Where the HTTPS server listens (``--webhook-listen``)."""
    port: int = 9443
    """The HTTPS port (``--webhook-port``)."""
    url: str | None = None
    """clientConfig: a base URL (``https://127.0.0.1:9443``, ``--webhook-url``); None: the
    Service below."""
    service: str = "offloadpool-webhook"
    """The Service in front of the webhook port, in ``namespace`` (``--webhook-service``)."""
    namespace: str = OperatorConfig.namespace
    """The operator's namespace (``--namespace``)."""
    cert_dir: str | None = None
    """Certificates: given ones (tls.crt/tls.key[/ca.crt]) or where made ones go
    (``--webhook-cert-dir``); None: a private temporary directory, removed at exit."""
    configuration: str = WEBHOOK_CONFIGURATION_NAME
    """Name of the Mutating/ValidatingWebhookConfiguration (``--webhook-configuration``)."""
    resync_seconds: float = 60.0
    """Seconds between checks of the configurations (``--webhook-resync``)."""
    injection: InjectionSettings = field(default_factory=InjectionSettings)
    """What a labelled pod is given (from ``--agent-image``, ``--sidecar-image``, ...)."""

    def endpoint(self) -> Endpoint:
        if self.url:
            return Endpoint(url=self.url)
        return Endpoint(service=self.service, namespace=self.namespace)

    def hostnames(self) -> list[str]:
        """The names the serving certificate must carry."""
        if self.url:
            host = urllib.parse.urlsplit(self.url).hostname
            assert host, f"--webhook-url {self.url!r} has no host"
            return [host]
        return certs.service_hostnames(self.service, self.namespace)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = WebhookOptions
    g = p.add_argument_group("admission webhook (pods labelled offloadpool.io/pool get the pool injected)")
    g.add_argument(
        "--webhook",
        action="store_true",
        help="serve the admission webhook and keep its configurations current",
    )
    g.add_argument("--webhook-listen", default=d.listen, help="address the HTTPS server listens on")
    g.add_argument("--webhook-port", type=int, default=d.port)
    g.add_argument("--webhook-url", help="base URL the API server calls (else the Service in --namespace)")
    g.add_argument("--webhook-service", default=d.service, help="Service in front of the webhook port")
    g.add_argument(
        "--webhook-cert-dir", help="tls.crt/tls.key[/ca.crt] to use, or where made certificates go"
    )
    g.add_argument(
        "--webhook-configuration",
        default=d.configuration,
        help="name of the Mutating/ValidatingWebhookConfiguration (created by the installer)",
    )
    g.add_argument(
        "--webhook-resync",
        type=float,
        default=d.resync_seconds,
        help="seconds between checks of the configurations",
    )
    g.add_argument(
        "--webhook-exclude-namespace",
        action="append",
        default=[],
        metavar="NS",
        help="a namespace never sent to the webhook (repeatable), besides the system ones and --namespace",
    )
    g.add_argument("--sidecar-image", help="image of the lease sidecar (default: --agent-image)")


def options_from_args(args: argparse.Namespace) -> WebhookOptions:
    injection = InjectionSettings(
        sidecar_image=args.sidecar_image or args.agent_image,
        sidecar_image_pull_policy=args.agent_image_pull_policy,
        kubelet_dir=args.kubelet_dir,
        excluded_namespaces=tuple(excluded_namespaces(args.namespace, args.webhook_exclude_namespace)),
    )
    return WebhookOptions(
        enabled=args.webhook,
        listen=args.webhook_listen,
        port=args.webhook_port,
        url=args.webhook_url,
        service=args.webhook_service,
        namespace=args.namespace,
        cert_dir=args.webhook_cert_dir,
        configuration=args.webhook_configuration,
        resync_seconds=args.webhook_resync,
        injection=injection,
    )


class ConfiguringWebhookServer(kopf.WebhookServer):
    """kopf's HTTPS server, plus: after every (re)start, point the configurations at it; every
    ``resync`` seconds, check them again and renew made certificates before they expire."""

    def __init__(self, options: WebhookOptions, configurator: Configurator, files: certs.CertFiles) -> None:
        super().__init__(
            addr=options.listen, port=options.port, certfile=files.cert, pkeyfile=files.key, cafile=files.ca
        )
        self.options = options
        self.configurator = configurator
        self.files = files
        self.bounds = endpoints.HttpBounds()

    async def __call__(self, fn: Any) -> AsyncIterator[Any]:
        keeper = asyncio.create_task(self._keep())
        try:
            async for client_config in self._serve_bounded(fn):
                await self._configure()
                yield client_config
        finally:
            keeper.cancel()

    async def _serve_bounded(self, fn: Any) -> AsyncIterator[Any]:
        """kopf's ``WebhookServer.__call__`` (same routes, SSL context and client config, a
        restart when the certificate files change), served within ``self.bounds``."""

        async def serve_fn(request: aiohttp.web.Request) -> aiohttp.web.Response:
            return await self._serve(fn, request)

        while True:
            cadata, context = self._build_ssl()
            path = self.path.rstrip("/") if self.path else ""
            app = endpoints.application(self.bounds)
            app.add_routes([aiohttp.web.post(f"{path}/{{id:.*}}", serve_fn)])
            addr = self.addr or None  # None: every address
            port = self.port or self._allocate_free_port()
            runner = await endpoints.serve(app, addr, port, self.bounds, ssl_context=context, reuse_port=True)
            try:
                host = self.host or self.DEFAULT_HOST or self._get_accessible_addr(self.addr)
                url = self._build_url("http" if context is None else "https", host, port, self.path or "")
                client_config = kopf.WebhookClientConfig(url=url)
                if cadata is not None:
                    client_config["caBundle"] = base64.b64encode(cadata).decode("ascii")
                yield client_config
                await self._files_changed()
                log.debug("webhook server: restarting with the renewed certificate files")
            finally:
                await runner.cleanup()

    async def _files_changed(self) -> None:
        """Return once the certificate files differ from what they were at the call (kopf's
        check: a digest of their bytes every ``file_check_interval`` seconds, as mounted
        Secrets change without a file system event)."""

        def digest() -> str:
            h = hashlib.sha256()
            for path in (self.certfile, self.pkeyfile, self.cafile):
                if path is not None:
                    h.update(Path(path).read_bytes())
            return h.hexdigest()

        first = await asyncio.to_thread(digest)
        while await asyncio.to_thread(digest) == first:
            await asyncio.sleep(self.file_check_interval)

    async def _configure(self) -> None:
        await asyncio.to_thread(publish, self.configurator, self.files, self.options.configuration)

    async def _keep(self) -> None:
        while True:
            await asyncio.sleep(self.options.resync_seconds)
            if self.files.made_here:
                # A new serving certificate makes kopf's server restart (it re-reads the files
                # each minute); a new bundle is written to the configurations just below.
                published = await asyncio.to_thread(read_published, self.configurator)
                await asyncio.to_thread(
                    certs.ensure, self.files.cert.parent, self.options.hostnames(), None, published
                )
            await self._configure()


def publish(configurator: Configurator, files: certs.CertFiles, configuration: str) -> bool:
    """Write the configurations with the bundle in ``files``; True when one was patched. An error
    is logged (retried every resync; the server keeps serving meanwhile)."""
    bundle = base64.b64encode(files.ca.read_bytes()).decode("ascii")
    try:
        return bool(configurator.ensure(bundle))
    except Exception as exc:
        log.error(
            "cannot update the webhook configurations %r: %s (install them with the chart or "
            "deploy/webhook.yaml; the operator may only get/patch them)",
            configuration,
            _short(exc),
        )
        return False


def read_published(configurator: Configurator) -> list[Any] | None:
    """The CAs the configurations trust now, or None when they cannot be read."""
    try:
        return configurator.published()
    except Exception as exc:
        log.warning("cannot read the webhook configurations' caBundle: %s", _short(exc))
        return None


def _short(exc: Exception) -> str:
    status = getattr(exc, "status", None)
    reason = getattr(exc, "reason", None)
    return f"{status} {reason}" if status else str(exc)


class WebhookRuntime:
    """What the admission handlers share (kopf ``memo['webhook']``): the options, the pool
    reader, and the server configured at start-up."""

    def __init__(self, options: WebhookOptions) -> None:
        self.options = options
        self._tmp: str | None = None
        self.kube: Any = None

    def cert_dir(self) -> Path:
        if self.options.cert_dir:
            return Path(self.options.cert_dir)
        if self._tmp is None:
            self._tmp = tempfile.mkdtemp(prefix="offloadpool-webhook-")
        return Path(self._tmp)

    def server(self) -> ConfiguringWebhookServer:
        """Certificates ready, API access loaded, the server to hand to kopf's settings."""
        from .kube import Kube, load_client

        client = load_client()
        self.kube = Kube(client)
        configurator = Configurator(
            client,
            self.options.endpoint(),
            self.options.injection.excluded_namespaces,
            self.options.configuration,
            kubelet_dir=self.options.injection.kubelet_dir,
        )
        published = read_published(configurator)
        files = certs.ensure(self.cert_dir(), self.options.hostnames(), published=published)
        # The bundle (a new CA next to the one the configurations trust) is written before the
        # server answers anything, so no certificate it serves is unknown to the API server.
        if publish(configurator, files, self.options.configuration):
            time.sleep(SETTLE_SECONDS)
        log.info(
            "admission webhook: https://%s:%d (%s certificates in %s), configurations %r",
            self.options.listen,
            self.options.port,
            "made" if files.made_here else "given",
            files.cert.parent,
            self.options.configuration,
        )
        return ConfiguringWebhookServer(self.options, configurator, files)

    def get_pool(self, name: str) -> dict[str, Any] | None:
        return self.kube.get_pool(name)

    def cleanup(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
