"""What tests share besides fixtures: loopback servers (servers.py), bounded polling (waiting.py), the tiny model's
configuration (models.py), the fake OpenAI upstream (fake_upstream.py) and gateways in front of it (gateways.py).
The conftests build their fixtures from these; test modules import them from here, never from a conftest."""
