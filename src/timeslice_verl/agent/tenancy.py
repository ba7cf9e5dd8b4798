"""The tenant's registration: which vLLM the agent lends the GPU to, and the rule for who may change it."""

from __future__ import annotations

import ipaddress
import urllib.parse
from typing import Any

import httpx

from timeslice_verl.agent.policy import TENANT_FAULTED
from timeslice_verl.agent.protocol import ErrorCode, ProtocolError
from timeslice_verl.agent.state import TenantRecord
from timeslice_verl.agent.tenant import ASLEEP, TenantError, TenantGroup, VllmTenant, make_tenant
from timeslice_verl.names import split_urls
from timeslice_verl.log import get_logger

log = get_logger("agent")


def _loopback(url: str) -> bool:
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class TenancyMixin:
    """Register, replace and forget the tenant (a tenant is never left asleep when it is forgotten)."""

    async def register_tenant(self, url: str, sleep_level: int = 1, *, persist: bool = True) -> dict[str, Any]:
        """Register (or re-check) the tenant. Registrations and unregistrations run one at a time, so
        an answer ``ok`` always means the tenant is registered when it is sent."""
        async with self._tenancy_lock:
            return await self._register_tenant(url, sleep_level, persist)

    async def _register_tenant(self, url: str, sleep_level: int, persist: bool) -> dict[str, Any]:
        url = ",".join(split_urls(url))
        if not all(_loopback(u) for u in split_urls(url)) and url != self.configured_tenant_url:
            raise ProtocolError(ErrorCode.PERMISSION, f"tenant {url!r} is not on this node (loopback): only the URL the agent "
                                "was started with (timeslice.tenant.url) may point elsewhere")
        if self.tenant is not None and self.tenant.url != url:
            raise ProtocolError(ErrorCode.BUSY, f"a tenant is already registered ({self.tenant.url}); unregister it first")
        try:
            tenant = self.tenant or self._make_tenant(url, sleep_level)
        except (httpx.InvalidURL, ValueError) as exc:  # what the HTTP client refuses is the request's fault
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"field 'url': {url!r:.200} is not a URL an HTTP client takes: {exc}") from None
        try:
            info = await tenant.register()
        except TenantError as exc:
            if self.tenant is None:
                await tenant.close()
            raise ProtocolError(ErrorCode.TENANT, str(exc)) from None
        async with self._step_lock:  # never swapped under a transition that uses it
            self.tenant = tenant
        self.tenant_rec = TenantRecord(url=tenant.url, state=tenant.state, version=info.version, sleep_level=sleep_level,
                                       error=tenant.note)
        if persist:
            self._persist()
        self.wake()
        return self.tenant_rec.to_dict()

    def _make_tenant(self, url: str, sleep_level: int) -> VllmTenant | TenantGroup:
        return make_tenant(
            url, sleep_level=sleep_level, request_timeout_s=self.tenant_request_timeout_s,
            drain_timeout_s=self.tenant_drain_timeout_s, pause_mode=self.tenant_pause_mode,
        )

    async def unregister_tenant(self) -> dict[str, Any]:
        """Forget the tenant, waking it first (it is never left asleep)."""
        async with self._tenancy_lock, self._step_lock:  # no registration, no transition meanwhile
            if self.tenant is None:
                return {"unregistered": False}
            if self.tenant_rec and self.tenant_rec.state in (ASLEEP, TENANT_FAULTED):
                try:
                    await self._tenant_reclaim(check_memory=False)
                except Exception as exc:
                    log.error("unregister: tenant could not be woken: %s", exc)
            url = self.tenant.url
            await self.tenant.close()
            self.tenant, self.tenant_rec = None, None
            self._persist()
        return {"unregistered": True, "url": url}

