"""KV transfer: block format, codecs, per-layer policy, transports and auth for streaming KV blocks."""
