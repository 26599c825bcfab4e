"""The wire formats every layer shares: OpenAI's request and response bodies, the one sampling schema,
vLLM's extras, SSE framing and the semantic-variable placeholder grammar. Depends on msgspec alone, so
``compat/`` (client-side helpers) can use it without the gateway or an engine."""
