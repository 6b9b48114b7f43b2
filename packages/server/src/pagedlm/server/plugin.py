"""pagedlm-server's hook implementations."""
