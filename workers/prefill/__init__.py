"""The prefill worker."""
