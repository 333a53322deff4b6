"""epd control plane: settings, scheduler, Redis state, ingress and admin APIs, CLI."""
