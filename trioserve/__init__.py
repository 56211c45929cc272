"""trioserve: an OpenAI-compatible LLM server with a Trio control plane over a C++ model worker."""

__version__ = "0.1.0"
