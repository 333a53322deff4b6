"""One real worker in its own process, for the fault tests (they kill and stop it):
``python worker_process.py POOL CHECKPOINT TOKEN [colocated] [kv=BYTES]``. Prints its address, then serves
until killed. ``kv=BYTES``: its KV pool's budget (default 64 MiB)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from kvtransfer.auth import TransferSecurity
from workers.run import start_worker
from workers.runtime.engine import EngineConfig
from workers.runtime.loader import load_model


def main() -> None:
    pool, ckpt, token = sys.argv[1:4]
    extra = sys.argv[4:]
    colocated = "colocated" in extra
    kv = next((int(a.removeprefix("kv=")) for a in extra if a.startswith("kv=")), 64 * 2**20)
    bundle = load_model(Path(ckpt))
    worker = start_worker(pool, bundle, TransferSecurity(token=token), codecs=("fp32",) * bundle.config.num_layers,  # type: ignore[arg-type]  # the pool from argv
                          config=EngineConfig(kv_cache_bytes=kv), colocated=colocated)
    print(worker.address, flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
