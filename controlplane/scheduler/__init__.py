"""The scheduler: routing policies, the worker view, admission, and the Backend the ingress calls."""
