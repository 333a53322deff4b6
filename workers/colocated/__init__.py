"""The colocated worker (prefill and decode in one engine): the aggregated baseline."""
