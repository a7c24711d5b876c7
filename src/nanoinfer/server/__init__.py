"""The OpenAI-compatible HTTP server and the web chat page over one engine (`nanoinfer serve`: cli/serve.py).

Files: `app` (create_app: the state, the route table), `state` (what every handler reads first: the state, the
API key, the body), `generation` (the completion routes), `routes` (the others), `tokenize_routes`,
`info_routes` and `load_routes` (what routers read), `doors` with `anthropic_api`, `responses_api` and
`ollama_api` (the other APIs, translated onto chat completions), `errors`
(failures as OpenAI error bodies), `running` (uvicorn, draining on SIGTERM), `loop` (the engine on its own
thread), `schemas` and `strict` (request bodies), `responses` (OpenAI response bodies), `openapi`, `metrics`
(Prometheus text), `static/` (the chat page). Only this docstring runs on import, so the CLI starts fast.
"""
