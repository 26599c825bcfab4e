"""The gateway's HTTP server, above everything else in gateway/: it composes the core (gateway/*.py), the
semantic layer (gateway/semantic/) and the dashboard (gateway/dashboard/) into one litestar app.

app.py               the app: its lifespan owns the one httpx client, registry, metrics, supervisor
routes.py            the core's routes (models, health, metrics, engine registration), and every route mounted
openai_endpoints.py  the two proxied OpenAI POSTs as plain ASGI handlers (body decoded once)
openapi.py           the served OpenAPI document, corrected where litestar cannot see
cli.py               `parrot serve` / `parrot engine`
"""
