"""Other APIs spoken over the chat-completions path: OpenAI's Responses and Anthropic's Messages, each a
request translated into a chat body and the chat answer (or stream) translated back. Pure: no I/O."""
