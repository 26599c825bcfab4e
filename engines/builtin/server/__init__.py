"""One builtin engine as an HTTP server process, above the engine core (engines/builtin/) and its OpenAI surface
(engines/builtin/serving/), which never import it. Torch-free to import: gateway/supervisor.py reads cli.py.

app.py         the HTTP app: OpenAI routes, context primitives, /v1/prompt_split; its lifespan owns the core
cli.py         `parrot engine`: every EngineConfig field a flag
membership.py  registration with a gateway, heartbeats, leaving
"""
