"""The OpenAI-compatible server: protocol models, the one decode worker, routes per endpoint, tool-call parsers."""
