"""Anthropic Messages: the wire format, pure (``wire``), and the adapter (``adapter``)."""
