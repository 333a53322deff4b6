"""A minimal OTLP/gRPC trace receiver on loopback: counts (and keeps, up to a bound) the spans exporters
send it. For tests of the OTLP path and for pricing export in ``epd bench controlplane``; not a
collector (it answers every Export with success and forgets beyond ``keep``)."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tgrpc


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str  # 32 hex digits
    span_id: str
    parent_span_id: str  # "" for a root


@dataclass
class OTLPSink(tgrpc.TraceServiceServicer):
    keep: int = 10_000
    received: int = 0
    spans: list[ReceivedSpan] = field(default_factory=list)
    services: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: grpc.Server | None = None
    port: int = 0

    def Export(self, request: tpb.ExportTraceServiceRequest, context: grpc.ServicerContext
               ) -> tpb.ExportTraceServiceResponse:
        got: list[ReceivedSpan] = []
        count, services = 0, set()
        for rs in request.resource_spans:
            service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
            services.add(service)
            for ss in rs.scope_spans:
                count += len(ss.spans)
                if self.keep:  # keep=0: count only, as cheaply as the parse allows
                    got.extend(ReceivedSpan(service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex())
                               for s in ss.spans)
        with self._lock:
            self.received += count
            self.services |= services
            room = max(0, self.keep - len(self.spans))
            self.spans.extend(got[:room])
        return tpb.ExportTraceServiceResponse()

    def start(self) -> OTLPSink:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="otlp-sink"))
        tgrpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        return self

    @property
    def endpoint(self) -> str:
        """What OTEL_EXPORTER_OTLP_ENDPOINT should say (http: plaintext gRPC)."""
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(0).wait()
            self._server = None


class OTLPSinkProcess:
    """An ``OTLPSink`` in a child process, as a real collector would be (its parsing then costs the
    measured processes nothing). ``stop()`` returns (spans received, service names seen)."""

    def __init__(self) -> None:
        import subprocess
        import sys

        self.proc = subprocess.Popen([sys.executable, "-m", "bench.otlp_sink"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("PORT "):
            self.proc.kill()
            raise RuntimeError(f"the OTLP receiver did not start: {line!r}")
        self.port = int(line.split()[1])

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> tuple[int, list[str]]:
        import json

        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()  # the child's signal to report and exit
        out = self.proc.stdout.read()
        self.proc.stdout.close()
        self.proc.wait(30)
        report: dict[str, Any] = (json.loads(out.strip().splitlines()[-1]) if out.strip()
                                  else {"received": 0, "services": []})
        return int(report["received"]), list(report["services"])


def _main() -> None:
    import json
    import sys

    sink = OTLPSink(keep=0).start()
    print(f"PORT {sink.port}", flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    sink.stop()
    print(json.dumps({"received": sink.received, "services": sorted(sink.services)}), flush=True)


if __name__ == "__main__":
    _main()
