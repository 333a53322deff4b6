"""The encode worker."""
