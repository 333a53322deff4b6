"""epd.kvtransfer: KV-cache and embedding transfer messages."""
