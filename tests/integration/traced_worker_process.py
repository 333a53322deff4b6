"""A decode worker in a process of its own, traced as a pool replica is: ``configure_process`` from the
standard OTEL_* variables in its environment. For the cross-process tracing tests.

    python tests/integration/traced_worker_process.py CHECKPOINT_DIR
Reads the worker's token from TRACED_WORKER_TOKEN, prints ``ADDRESS host:port`` once serving, and
stops (flushing its spans) when its stdin closes.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    from controlplane.observability.deploy import configure_process
    from controlplane.observability.tracing import stop_exporting
    from controlplane.settings import ObservabilitySettings
    from kvtransfer.auth import TransferSecurity
    from workers.run import start_worker
    from workers.runtime.loader import load_model

    configure_process(ObservabilitySettings(metrics=False, tracing=True), "epd-test-worker")
    bundle = load_model(sys.argv[1])
    worker = start_worker("decode", bundle, TransferSecurity(token=os.environ["TRACED_WORKER_TOKEN"]),
                          codecs=("fp32",) * bundle.config.num_layers)
    print(f"ADDRESS {worker.address}", flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    worker.stop()
    stop_exporting()  # what was recorded reaches the collector before the process ends


if __name__ == "__main__":
    main()
