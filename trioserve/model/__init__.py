"""What is known about a model, with no I/O: chat templates (``chat_template``), serving
profiles (``profiles``), reasoning markers (``reasoning``), tool-call formats and their grammars
(``tool_formats``) and the JSON Schema subset that can be enforced (``schema_subset``)."""
