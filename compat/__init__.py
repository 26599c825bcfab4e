"""Client side of Parrot: openai SDK helpers (compat.openai), semantic functions (compat.frontend) and
LangChain integration (compat.langchain)."""
