"""The edge's settings (flags, DRIVETRAIN_* environment, profile; see shared/settings.py)."""

from __future__ import annotations

from typing import Any, ClassVar

from shared.models.spec import ServedModel
from shared.service_settings import ServiceSettings
from shared.settings import Section


class InternalListener(Section):
    host: str = "127.0.0.1"
    """address routers connect to; published to them through gossip (as the host name when 0.0.0.0)"""
    port: int = 9180
    """port routers connect to"""


class EdgeSettings(ServiceSettings, ServedModel):
    """drivetrain edge: holds client WebSockets, admits chats, writes their tokens back."""

    profiles: ClassVar[dict[str, dict[str, Any]]] = {"compose": {"host": "0.0.0.0", "internal": {"host": "0.0.0.0"}}}

    edge_id: str = "edge-0"
    """unique name of this edge: routes name it, token messages are keyed by it, routers find it in gossip by it"""
    host: str = "127.0.0.1"
    """address of the client endpoint"""
    port: int = 8080
    """client port: WebSocket /v1/chat, the OpenAI-compatible API, the chat page, /healthz, /metrics"""
    internal: InternalListener = InternalListener()
    api_keys: str = "dev-key:dev"
    """accepted API keys, key:tenant[,key:tenant]; a malformed entry stops the edge at start"""
    tenant_tiers: str = ""
    """tenants' service tiers, tenant:tier[,...]; others are 'standard'. Today a tier only labels metrics"""
    max_frame_bytes: int = 1024 * 1024
    """largest client frame (a bigger one closes the socket with 1009) and HTTP request body (413)"""
    max_chats_per_connection: int = 64
    """chats one socket may have in flight at once; more are refused with too_many_chats"""
    progress_timeout_s: float = 30.0
    """a started chat silent this long fails with worker_lost"""
    start_timeout_s: float = 120.0
    """a chat no worker starts within this fails with no_worker"""
    resume_grace_s: float = 10.0
    """how long a dropped socket's streams wait to be resumed before the workers are told to cancel them"""
