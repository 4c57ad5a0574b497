"""The edge's settings (flags, DRIVETRAIN_* environment, profile; see shared/settings.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar

from pydantic import Field

from services.edge.placement_settings import PlacementSettings
from services.edge.region_settings import RegionSettings
from services.edge.tenancy_settings import TenancySettings
from shared.models.cache_salt import CacheSharing
from shared.models.spec import ServedModel
from shared.service_settings import ServiceSettings
from shared.settings import Section
from shared.topics import MAX_FRAME_BYTES


class InternalListener(Section):
    host: str = "127.0.0.1"
    """address routers connect to; published to them through gossip (as the host name when 0.0.0.0)"""
    port: int = 9180
    """port routers connect to"""


class ClientLimits(Section):
    """What one client, known or not, may hold or spend on the client port."""

    header_timeout_s: float = 10.0
    """an HTTP request's headers (a WebSocket handshake's too) must all arrive within this of its first byte, or the connection is closed (408)"""
    body_timeout_s: float = 30.0
    """an HTTP request's body must all arrive within this of its headers, or the connection is closed (408)"""
    idle_timeout_s: int = 5
    """an HTTP keep-alive connection with no request for this long is closed"""
    refused_handshakes_per_s: float = 1.0
    """refused WebSocket handshakes (bad key, bad origin) one client address may make per second on average; past the burst, all its handshakes get 429"""
    refused_handshakes_burst: int = 20
    """refused handshakes one address may make at once before that limit applies"""
    frames_per_s: float = 50.0
    """frames one socket may send per second on average; past the burst the socket is closed with 1008"""
    frames_burst: int = 200
    """frames one socket may send at once before that limit applies"""
    allowed_origins: str = ""
    """web origins (scheme://host[:port], comma-separated) whose pages may open a chat socket, besides the edge's own (its chat page); * allows every origin. Clients that send no Origin (not browsers) are not affected"""


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
    clients: ClientLimits = ClientLimits()
    tenancy: TenancySettings = TenancySettings()
    placement: PlacementSettings = PlacementSettings()
    regions: RegionSettings = RegionSettings()
    engine: CacheSharing = CacheSharing()
    """the workers' prefix-cache isolation (their engine section's cache_isolation and cache_groups, the same flags and variables): placement salts a prompt's block hashes as they do"""
    tenants_file: Path | None = None
    """the tenants file (TOML: tenants, tiers, SHA-256 hashes of their keys, limits; `drivetrain tenants` edits it), re-read when it changes; unset: api_keys and tenant_tiers"""
    api_keys: str = "dev-key:dev"
    """without a tenants file: accepted API keys, key:tenant[,key:tenant]; a malformed entry stops the edge at start"""
    tenant_tiers: str = ""
    """without a tenants file: tenants' service tiers, tenant:tier[,...]; others are 'standard'"""
    max_frame_bytes: Annotated[int, Field(ge=1024, le=MAX_FRAME_BYTES)] = MAX_FRAME_BYTES
    """largest client frame (a bigger one closes the socket with 1009) and HTTP request body (413); at most 1 MiB, what the Kafka topics are sized for"""
    max_chats_per_connection: int = 64
    """chats one socket may have in flight at once; more are refused with too_many_chats"""
    progress_timeout_s: float = 30.0
    """a started chat silent this long fails with worker_lost"""
    admit_timeout_s: Annotated[float, Field(gt=0)] = 5.0
    """how long a new chat (or a cancel, a resume) waits for Kafka to take its record before it is refused as unavailable (retryable), so a broker that stops answering holds no socket; a request Kafka takes later is cancelled"""
    start_timeout_s: float = 120.0
    """a chat no worker starts within this fails with no_worker"""
    resume_grace_s: float = 10.0
    """how long a dropped socket's streams wait to be resumed before the workers are told to cancel them"""
    responses_ttl_s: Annotated[float, Field(gt=0)] = 3600.0
    """how long a finished /v1/responses answer stays in the Redis Cluster for a later `previous_response_id` (unless the request said `store: false`)"""
    drain_timeout_s: float = 25.0
    """on SIGTERM, how long streams in flight may take to finish before every socket is closed as going away (1001); longer than the workers' drain_timeout_s, so their last words arrive"""
