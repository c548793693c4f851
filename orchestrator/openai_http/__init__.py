"""The orchestrator's OpenAI-compatible HTTP API: request schemas (schemas), response bodies
(responses), routes (app) and the uvicorn server in the orchestrator's loop (server). docs/http.md."""
