"""Black-box conformance suite for OpenAI-compatible chat servers (spec/README.md, v1.0).

Run ``python -m conformance --help``, or ``pytest conformance`` with OPENAI_BASE_URL and
OPENAI_MODEL set. See conformance/README.md.
"""

SPEC_VERSION = "1.1"
AREAS = ("core", "streaming", "strict", "errors", "tools", "structured", "sessions", "cancellation",
         "concurrency", "messages", "legacy", "responses")
