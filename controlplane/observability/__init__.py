"""Metrics (Prometheus, ``epd:`` prefix), tracing (OpenTelemetry, W3C context in gRPC metadata) and
the per-request records the dashboard reads.

  metrics.py    every metric, the on/off switches, the per-request records, pool gauges at scrape time
  tracing.py    the OpenTelemetry SDK's provider, batch processor, OTLP exporter and sampler from the
                standard OTEL_* variables; spans with explicit parents; W3C propagation
  http.py       the ingress side: root span, request counters, TTFT / TPOT / ITL / E2E
  stages.py     what the dispatcher and scheduler call around each stage and worker call
  deploy.py     wiring for one process (switches, exporter) and for the control plane (gauges, dashboard)
  server_timing.py  the Server-Timing header (an answer's engine time) and its reader

The workers' half of a trace (continuing the context from gRPC metadata) is ``workers/tracing.py``:
imports point one way, so it cannot live here. See docs/observability.md.
"""
