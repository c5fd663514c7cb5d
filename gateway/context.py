"""The gateway's process-wide state, shared by the REST routes and the client gRPC API."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from common.generation_defaults import check_mode
from common.tenants import Tenant
from gateway.backend import ModelState, SchedulerBackend
from gateway.conversion import InternalRequest
from gateway.generation import ActiveRequests, Generation
from gateway.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_IN_FLIGHT, InFlightLimit
from gateway.metrics import GatewayMetrics
from gateway.tenants import TenantGate


@dataclass(slots=True)
class GatewaySettings:
    scheduler_addr: str = "127.0.0.1:50051"
    host: str = "127.0.0.1"
    grpc_port: int = 50050  # 0: no client gRPC API
    served_model_name: str | None = None
    api_key: str | None = None
    rpc_timeout_s: float = 5.0
    request_timeout_s: float | None = None  # deadline of one Generate stream; None: none
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT  # REST /v1/* and client gRPC together; 0: none
    generation_config: str = "auto"  # unset sampling fields: common/generation_defaults.py
    # This replica's name for a router (/get_server_info, the X-SuperInfer-Replica header).
    replica_id: str = ""
    tenants_file: str | None = None  # keys, limits and defaults per tenant (gateway/tenants.py)

    def __post_init__(self) -> None:
        check_mode(self.generation_config)
        if self.tenants_file and self.api_key:
            raise ValueError(
                "both a tenants file (--tenants) and one API key ($SUPERINFER_API_KEY or "
                "--api-key) are set; with tenants every key belongs to a tenant: put its hash "
                "in the file (`superinfer tenants hash-key`) and unset the single key")
        if self.max_body_bytes < 1:
            raise ValueError(f"--max-body-bytes must be at least 1, got {self.max_body_bytes}")
        if self.max_in_flight < 0:
            raise ValueError(f"--max-in-flight must be >= 0 (0: no limit), got {self.max_in_flight}")


@dataclass(slots=True)
class GatewayContext:
    settings: GatewaySettings
    backend: SchedulerBackend
    in_flight: InFlightLimit
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    active: ActiveRequests = field(default_factory=ActiveRequests)
    started: int = field(default_factory=lambda: int(time.time()))
    tenants: TenantGate | None = None  # None: no tenants file

    @classmethod
    def create(cls, settings: GatewaySettings) -> GatewayContext:
        """The context `settings` describe; a bad tenants file raises TenantsError."""
        backend = SchedulerBackend(
            settings.scheduler_addr,
            served_model_name=settings.served_model_name,
            rpc_timeout_s=settings.rpc_timeout_s,
            generate_timeout_s=settings.request_timeout_s,
            generation_config=settings.generation_config,
        )
        gate = TenantGate.from_file(settings.tenants_file) if settings.tenants_file else None
        return cls(settings=settings, backend=backend,
                   in_flight=InFlightLimit(settings.max_in_flight), tenants=gate)

    def generation(self, model: ModelState, req: InternalRequest, *, request_id: str,
                   arrival: float | None, tenant: Tenant | None = None) -> Generation:
        """The request's life from here: submit, stream, detokenize, stop, clean up.
        With tenants, `req` first takes the tenant's defaults and its prompt from the
        tenant's token bucket (raising the 429 when it is empty), and the output tokens are
        charged when it ends."""
        charge = None
        if self.tenants is not None and tenant is not None:
            gate = self.tenants
            req = gate.admit(tenant, req)

            def charge(tokens: int) -> None:
                gate.charge(tenant, tokens)

        return Generation(
            backend=self.backend, metrics=self.metrics, active=self.active, model=model,
            request=req.scheduler_request(request_id), stop=req.stop, arrival=arrival,
            on_finish=charge,
        )

