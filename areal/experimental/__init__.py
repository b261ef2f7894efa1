"""The agent stack: ``areal.experimental.openai`` (``ArealOpenAI`` client, interaction cache,
tool-call parsing) and, built on it, the OpenAI-compatible proxy for agent programs."""
