"""epd.worker: the encode, prefill and decode worker services."""
