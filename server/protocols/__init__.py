"""The protocols served beside chat completions, each translated into a ChatCompletionRequest that
the chat pipeline runs (server/routes/chat.py: template, tool parsers, forced calls, structured
outputs) and its chat.completion body or chunks translated back: Anthropic's Messages API
(anthropic, anthropic_stream) and OpenAI's Responses API (responses, responses_stream)."""
