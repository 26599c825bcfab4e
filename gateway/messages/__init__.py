"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API) over the chat-completions path."""
