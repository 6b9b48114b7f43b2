"""pagedlm-server: an OpenAI-compatible HTTP server for the pagedlm engine (``pagedlm serve``)."""
