"""POST /v1/responses over the chat-completions path: the store of responses (store.py) and the service
that runs them, plain, streamed or in the background (service.py)."""
