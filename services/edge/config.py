"""The edge's frozen config (flags, DRIVETRAIN_* environment, profile)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import CommonConfig, doc


@dataclass(frozen=True)
class EdgeConfig(CommonConfig):
    """drivetrain edge: holds client WebSockets, admits chats, writes their tokens back."""

    edge_id: str = doc("unique name of this edge; routers address it by this", "edge-0")
    host: str = doc("address the client endpoint listens on", "127.0.0.1")
    port: int = doc("port of the client endpoint (WebSocket /v1/chat)", 8080)
    internal_host: str = doc("address routers connect to", "127.0.0.1")
    internal_port: int = doc("port routers connect to", 9180)
    api_keys: str = doc("accepted API keys, key:tenant[,key:tenant]", "dev-key:dev")
    tenant_tiers: str = doc("tenants' service tiers, tenant:tier[,...]; others are 'standard'", "")
    max_frame_bytes: int = doc("largest client frame; a bigger one closes the socket with 1009", 1024 * 1024)
    model: str = doc("the model the workers serve; sets how prompts are counted against its context", "echo")
    max_model_len: int = doc("the workers' max_model_len (0: the same default, the model's context up to 8192)", 0)
    max_chats_per_connection: int = doc("chats one socket may have in flight at once", 64)
    progress_timeout_s: float = doc("a started chat silent this long fails with worker_lost", 30.0)
    start_timeout_s: float = doc("a chat no worker starts within this fails with no_worker", 120.0)
    resume_grace_s: float = doc("how long a dropped socket's streams wait to be resumed before cancelling", 10.0)
